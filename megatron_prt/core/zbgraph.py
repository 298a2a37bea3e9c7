"""The tables a split-backward (F, I, W) list-scheduling run reads, made once per
placement and micro-batch split and shared by every run of the portfolio
(:mod:`megatron_prt.core.zerobubble`). All read-only. Actions are indices into
:func:`graph`'s list (hashing an :class:`Action` costs more than a scheduling step).

[Note: judging a run as it is made]
The portfolio judges a run by :func:`~megatron_prt.core.replay.replay` of its orders under
the stage times plans are compared by. A run starts every action after its producers
finished, and each rank starts its actions in its order: the run's start order is a
dependency order of its own orders. The replay's result does not depend on which
dependency order it walks (each action starts at the latest of its rank's previous end and
its producers' ends plus a hop), so :class:`Judge` walks the run's start order as the run
makes it and has, at each start, the replay's end of that action, in the replay's own
integer ticks (``times.in_ticks()``, the same busy times): the same makespan, to the tick.
Every rank's actions not yet started run after its last replayed end, one after another,
so ``end + work left`` of any rank bounds the replay's makespan from below while the run
is being made: a run whose bound passes the best makespan so far cannot win or tie, and
stops there (its orders are never a plan).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from .actions import Action, Op
from .deps import consumers_map, producers
from .placement import Placement
from .timing import StageTimes


def split_actions(placement: Placement, mb_pipeline: Sequence[int]) -> list[Action]:
    """Every F, I and W of a plan, in flow order per micro-batch."""
    out = []
    for mb, pipe in enumerate(mb_pipeline):
        stages = placement.pipelines[pipe]
        out += [Action(stage, Op.F, mb) for stage in stages]
        out += [Action(stage, Op.I, mb) for stage in reversed(stages)]
        out += [Action(stage, Op.W, mb) for stage in reversed(stages)]
    return out


@functools.lru_cache(maxsize=16)
def graph(placement: Placement, mb_pipeline: tuple[int, ...]):
    """The actions, per action the ``(index, stage)`` of its consumers, and how many
    producers each waits for, whether each is on its micro-batch's first stage on its rank,
    and each one's kind (0, 1, 2: F, I, W)."""
    actions = split_actions(placement, mb_pipeline)
    index = {a: i for i, a in enumerate(actions)}
    consumers = consumers_map(actions, placement, split=True)
    users = [tuple((index[c], c.stage) for c in consumers[a]) for a in actions]
    counts = [len(producers(a, placement, split=True)) for a in actions]
    first = {}  # (rank, pipeline) -> the rank's first stage in it
    for pipe, stages in enumerate(placement.pipelines):
        for stage in reversed(stages):
            first[placement.rank_of(stage), pipe] = stage
    enters = [a.stage == first[placement.rank_of(a.stage), mb_pipeline[a.mb]] for a in actions]
    kinds = [(Op.F, Op.I, Op.W).index(a.op) for a in actions]
    return actions, users, counts, enters, kinds


def busy_ticks(placement: Placement, ticks: StageTimes) -> tuple[tuple[int, ...], ...]:
    """Per kind (F, I, W) and stage: its rank's busy time in ``ticks`` (integer stage times,
    :meth:`StageTimes.in_ticks`), as :meth:`StageTimes.busy` gives it (messages' CPU in)."""
    stages = range(placement.num_stages)
    return tuple(
        tuple(ticks.busy(Action(stage, op, 0), placement) for stage in stages)
        for op in (Op.F, Op.I, Op.W)
    )


@functools.lru_cache(maxsize=32)
def durations(placement, mb_pipeline, busy) -> tuple[int, ...]:
    """Per action of :func:`graph`: ``busy[kind][stage]`` (:func:`busy_ticks`)."""
    actions, _, _, _, kinds = graph(placement, mb_pipeline)
    return tuple(busy[k][a.stage] for k, a in zip(kinds, actions, strict=True))


@functools.lru_cache(maxsize=16)
def action_facts(placement, mb_pipeline, stage_bytes, busy):
    """Per action of :func:`graph`: its bytes, its duration in ticks (:func:`durations`)
    and the bytes of all its micro-batch's stages on its rank (what ``reserve`` sets aside
    as the micro-batch enters)."""
    chains: dict[tuple[int, int], float] = {}
    for pipe, stages in enumerate(placement.pipelines):
        for stage in stages:
            key = placement.rank_of(stage), pipe
            chains[key] = chains.get(key, 0.0) + stage_bytes[stage]
    actions = graph(placement, mb_pipeline)[0]
    size = [stage_bytes[a.stage] for a in actions]
    chain = [chains[placement.rank_of(a.stage), mb_pipeline[a.mb]] for a in actions]
    return size, durations(placement, mb_pipeline, busy), chain


@functools.lru_cache(maxsize=64)
def queue_keys(
    placement: Placement, mb_pipeline: tuple[int, ...], fwd_order: str, inp_order: str
) -> list[tuple]:
    """Per action of :func:`graph`, its key in its rank's ready queue (smallest first) under
    the policy's ``fwd_order`` and ``inp_order``."""
    group_width = placement.ranks * placement.num_pipelines
    groups = max(1, len(mb_pipeline) // group_width)
    keys = []
    for stage, op, mb in graph(placement, mb_pipeline)[0]:
        order = fwd_order if op is Op.F else inp_order if op is Op.I else None
        if order == "deepest":
            keys.append((-stage, mb))
        elif order == "grouped":
            chunk = (stage % placement.depth) // placement.ranks
            group = min(mb // group_width, groups - 1)
            keys.append((group, chunk if op is Op.F else -chunk, mb))
        else:
            keys.append((mb, -stage if op is Op.F else stage))
    return keys


@dataclass(frozen=True)
class Judge:
    """The replay of runs' orders under ``times``, made as runs start their actions ([Note:
    judging a run as it is made]). Per action of :func:`graph`: ``duration`` (busy ticks of
    ``times.in_ticks()``) and ``producers`` (``(index, hop)`` pairs: the ticks that edge
    adds, 0 on one rank); per rank its ``work``; ``tick``: time units per tick."""

    duration: tuple[int, ...]
    producers: tuple[tuple[tuple[int, int], ...], ...]
    work: tuple[int, ...]
    tick: float

    @classmethod
    @functools.lru_cache(maxsize=16)
    def of(cls, placement: Placement, mb_pipeline: tuple[int, ...], times: StageTimes) -> Judge:
        ticks, tick = times.in_ticks()
        actions, users = graph(placement, mb_pipeline)[:2]
        duration = durations(placement, mb_pipeline, busy_ticks(placement, ticks))
        rank_of = placement.stage_to_rank
        inputs: list[list[tuple[int, int]]] = [[] for _ in actions]  # per action: producers
        for index, action in enumerate(actions):
            for user, stage in users[index]:
                crosses = rank_of[stage] != rank_of[action.stage]
                inputs[user].append((index, ticks.cut_hop(stage, action.stage) if crosses else 0))
        work = [0] * placement.ranks
        for action, busy in zip(actions, duration, strict=True):
            work[rank_of[action.stage]] += busy
        return cls(duration, tuple(map(tuple, inputs)), tuple(work), tick)
