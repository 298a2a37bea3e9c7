"""The list scheduler's compiled view of (placement, micro-batch split): :class:`Graph`.

A plan of P=64, R=8, m=512 has half a million actions and the portfolio of
:mod:`megatron_prt.core.schedules` schedules it several times, so
:mod:`megatron_prt.core.greedy` runs on a graph compiled once per configuration: actions are
integers, per-id facts are lists (one micro-batch's template repeated), and each heap entry
is one integer (key, then action). Actions become :class:`Action` values only for the plan
that is kept.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from itertools import chain, repeat
from operator import add, itemgetter, mod
from typing import NamedTuple

from .actions import Action, Op
from .columns import RankActions
from .deps import producers
from .placement import Placement
from .timing import StageTimes


class SortKey(NamedTuple):
    """A preference among actions: ``by_stage[stage] + by_mb[mb]``, lower runs first. Two
    tables rather than a function so that keying half a million actions is arithmetic.
    Distinct (stage, mb) must get distinct keys (ties would fall to the action id)."""

    by_stage: Sequence[int]
    by_mb: Sequence[int]

    def __call__(self, stage: int, mb: int) -> int:
        return self.by_stage[stage] + self.by_mb[mb]


def oldest_first(num_stages: int, num_microbatches: int) -> SortKey:
    """(mb, stage): the oldest micro-batch first, then the lowest stage."""
    return SortKey(range(num_stages), range(0, num_microbatches * num_stages, num_stages))


class Graph:
    """The F/B actions of (placement, micro-batch split) as integers, with what every policy
    shares: id ``mb * 2D + 2 * position + (0 for F, 1 for B)`` (position: flow position in
    the micro-batch's pipeline); ``stage``/``mb``/``rank``/``kinds`` per id (kind:
    ``2 * stage + op bit``); ``producer_counts`` per id, from
    :func:`megatron_prt.core.deps.producers` less the implied ones (below);
    ``consumers[pipe][offset]``: ``(offset of a consumer, whether the edge crosses ranks)``
    within one micro-batch of that pipeline (the rule never crosses micro-batches). Every
    per-id list is one micro-batch's template repeated. Read-only once built.

    [Note: implied producers]
    A backward waits for its own forward and for the next stage's backward, which waits for
    the next stage's forward, which waits for this forward: so the scheduler takes that
    forward's finish before the next stage's forward starts, before that backward finishes,
    and waits for the backward alone. Its readiness comes at the same instant, and with hops
    at the same tick (the forward runs on the backward's rank: no hop, earlier finish). So
    every action waits for one producer at most and readies one at most (checked): it is
    ready once that one is, a micro-batch's actions one chain."""

    def __init__(self, placement: Placement, mb_pipeline: tuple[int, ...]) -> None:
        self.placement, self.mb_pipeline = placement, mb_pipeline
        self.width = width = 2 * placement.depth
        pipes = range(placement.num_pipelines)
        stage_t = [[p * placement.depth + j // 2 for j in range(width)] for p in pipes]
        rank_t = [[placement.stage_to_rank[s] for s in stages] for stages in stage_t]
        self._counts_t, self.consumers = zip(
            *(self._edges(p, rank_t[p]) for p in pipes), strict=True
        )
        # per pipeline, per offset: the kind (2 * stage + op bit); ``kinds`` tiles it
        self.kind_templates = [[2 * s + (j & 1) for j, s in enumerate(st)] for st in stage_t]
        self.stage, self.rank = _tile(stage_t, mb_pipeline), _tile(rank_t, mb_pipeline)
        self.mb = list(chain.from_iterable(map(repeat, range(len(mb_pipeline)), repeat(width))))
        self.n = len(self.stage)

    def _edges(self, pipe: int, ranks: list[int]) -> tuple[list[int], list[tuple]]:
        """One micro-batch of ``pipe``: producer count and consumers per offset."""
        placement, depth = self.placement, self.placement.depth
        counts = [0] * self.width
        consumers: list[list[tuple[int, bool]]] = [[] for _ in range(self.width)]
        for offset in range(self.width):
            action = Action(pipe * depth + offset // 2, (Op.F, Op.B)[offset & 1], 0)
            deps = producers(action, placement)
            for dep in deps:
                dep_offset = 2 * (dep.stage - pipe * depth) + (dep.op is Op.B)
                if dep.stage == action.stage and deps[-1].op is Op.B:
                    continue  # a backward's own forward: see [Note: implied producers]
                counts[offset] += 1
                consumers[dep_offset].append((offset, ranks[offset] != ranks[dep_offset]))
        if max(counts) > 1 or max(map(len, consumers)) > 1:
            raise ValueError(
                f"pipeline {pipe}: an action waits for two producers or readies two, none "
                "implied by another: the list scheduler takes a micro-batch's actions as one "
                "chain ([Note: implied producers] in megatron_prt/core/graph.py); extend it"
            )
        return counts, [tuple(users) for users in consumers]

    def kinds_of(self, ids: list[int]) -> list[int]:
        """:attr:`kinds` of ``ids``: ``id mod (width * pipelines)`` when micro-batches take
        the pipelines in turn (what :func:`~megatron_prt.core.plan.split_microbatches`
        does), arithmetic rather than a look-up in a half-million-long table."""
        pipes = self.placement.num_pipelines
        if self.mb_pipeline != tuple(mb % pipes for mb in range(len(self.mb_pipeline))):
            return list(map(self.kinds.__getitem__, ids))
        return list(map(mod, ids, repeat(self.width * pipes)))

    @functools.cached_property
    def kinds(self) -> list[int]:
        """id -> its kind ``2 * stage + op bit`` (made when asked: the scheduler reads the
        per-kind templates)."""
        return self.tiled(self.kind_templates)

    @functools.cached_property
    def producer_counts(self) -> list[int]:
        """id -> how many producers it waits for (made when asked, see :attr:`sources`)."""
        return self.tiled(self._counts_t)

    def tiled(self, templates: Sequence[list]) -> list:
        """Per id the entry of its offset in its pipeline's template (one list per pipeline,
        ``width`` long): a per-micro-batch table tiled over every micro-batch."""
        return _tile(templates, self.mb_pipeline)

    @functools.cached_property
    def sources(self) -> list[int]:
        """The ids with no producer (a pipeline's first forward), from one micro-batch's
        template per pipeline (the counts repeat per micro-batch)."""
        width = self.width
        firsts = [[j for j in range(width) if not counts[j]] for counts in self._counts_t]
        return [mb * width + j for mb, pipe in enumerate(self.mb_pipeline) for j in firsts[pipe]]

    @functools.cached_property
    def consumer_steps(self) -> tuple[list[int], list[bool]]:
        """Per id: how far ahead its one consumer's id lies (0: none), and whether that edge
        crosses ranks (the scheduler's view of :attr:`consumers`: ``id + step``)."""
        steps_t, crossing_t = [], []
        for users in self.consumers:
            steps_t.append([edges[0][0] - j if edges else 0 for j, edges in enumerate(users)])
            crossing_t.append([bool(edges) and edges[0][1] for edges in users])
        return _tile(steps_t, self.mb_pipeline), _tile(crossing_t, self.mb_pipeline)

    def consumer_hops(self, ticks: StageTimes) -> list[int]:
        """Per id: the ticks its consumer edge adds under ``ticks`` (integer stage times),
        0 on one rank or with no consumer (:meth:`StageTimes.cut_hop` of the edge's cut)."""
        depth, templates = self.placement.depth, []
        for pipe, users in enumerate(self.consumers):
            stage = [pipe * depth + offset // 2 for offset in range(self.width)]
            templates.append(
                [
                    ticks.cut_hop(stage[j], stage[edges[0][0]]) if edges and edges[0][1] else 0
                    for j, edges in enumerate(users)
                ]
            )
        return _tile(templates, self.mb_pipeline)

    @functools.cached_property
    def producer_ids(self) -> tuple[list[int], list[int]]:
        """Per id its producers' ids in :func:`megatron_prt.core.deps.producers`' order, as
        two slots (``n`` where an action has fewer producers)."""
        return self._per_id(0, self.n), self._per_id(1, self.n)

    def _per_id(self, slot: int, none: int) -> list[int]:
        """Slot 0 or 1 of the producers, or (2) the producer on another rank, as ids."""
        templates = [offsets[slot] for offsets in self.producer_offsets]
        out: list[int] = []
        for mb, pipe in enumerate(self.mb_pipeline):
            base = mb * self.width
            out += [none if o < 0 else base + o for o in templates[pipe]]
        return out

    @functools.cached_property
    def producer_offsets(self) -> list[tuple[list[int], ...]]:
        """Per pipeline, one micro-batch: per offset the offsets of its first and second
        producer and of its producer on another rank (-1: none)."""
        placement, depth, width = self.placement, self.placement.depth, self.width
        rank, out = placement.stage_to_rank, []
        for pipe in range(placement.num_pipelines):
            slots: tuple[list[int], ...] = ([-1] * width, [-1] * width, [-1] * width)
            for offset in range(width):
                action = Action(pipe * depth + offset // 2, (Op.F, Op.B)[offset & 1], 0)
                for slot, dep in enumerate(producers(action, placement)):
                    slots[slot][offset] = 2 * (dep.stage - pipe * depth) + (dep.op is Op.B)
                    if rank[dep.stage] != rank[action.stage]:
                        slots[2][offset] = slots[slot][offset]
            out.append(slots)
        return out

    @functools.cached_property
    def actions(self) -> list[Action]:
        """id -> :class:`Action` (built on first use: only kept plans need them)."""
        rows = zip(self.stage, self._ops, self.mb, strict=True)
        return list(map(tuple.__new__, repeat(Action), rows))  # Action._make, without a call

    def rank_actions(self, ids: list[int]) -> RankActions:
        """The actions of ``ids``, in this order, as columns (see [Note: columnar ranks]
        in :mod:`megatron_prt.core.columns`): no :class:`Action` is made until asked for."""
        if len(ids) < 2:  # itemgetter of one id returns the value, not a tuple
            return RankActions(*(tuple(table[i] for i in ids) for table in self._columns))
        pick = itemgetter(*ids)
        return RankActions(*map(pick, self._columns))

    @property
    def _columns(self) -> tuple[list[int], list[Op], list[int]]:
        return self.stage, self._ops, self.mb

    @functools.cached_property
    def backward(self) -> list[bool]:
        """id -> whether it is a backward (ids alternate F, B): a look-up, cheaper in the
        scheduler's loop than ``id & 1``."""
        return [False, True] * (self.n // 2)

    @functools.cached_property
    def _ops(self) -> list[Op]:
        """id -> its op (ids alternate F, B)."""
        return [Op.F, Op.B] * (self.n // 2)

    def busy_per_kind(self, ticks: StageTimes) -> list[int]:
        """Per kind ``2 * stage + op bit``: its rank's busy time under ``ticks``; read-only,
        kept for the next policy of a portfolio (the last stage times asked only)."""
        kept = self.__dict__.get("_busy")
        if kept is None or kept[0] != ticks:
            placement = self.placement
            per_kind = [
                ticks.busy(Action(stage, op, 0), placement)
                for stage in range(placement.num_stages)
                for op in (Op.F, Op.B)
            ]
            kept = self._busy = (ticks, per_kind)
        return kept[1]

    def durations(self, ticks: StageTimes) -> list[int]:
        """id -> its rank's busy time under ``ticks`` (integer stage times); read-only, kept
        for the next policy of a portfolio (the last stage times asked only)."""
        kept = self.__dict__.get("_durations")
        if kept is None or kept[0] != ticks:
            per_kind = self.busy_per_kind(ticks)
            templates = [list(map(per_kind.__getitem__, kinds)) for kinds in self.kind_templates]
            kept = self._durations = (ticks, _tile(templates, self.mb_pipeline))
        return kept[1]

    def work_per_rank(self, ticks: StageTimes) -> list[int]:
        """rank -> the busy time of all its actions under ``ticks``."""
        placement, per_kind = self.placement, self.busy_per_kind(ticks)
        mbs = [self.mb_pipeline.count(p) for p in range(placement.num_pipelines)]
        work = [0] * placement.ranks
        for stage, rank in enumerate(placement.stage_to_rank):
            both = per_kind[2 * stage] + per_kind[2 * stage + 1]
            work[rank] += mbs[placement.pipeline_of(stage)] * both
        return work

    def heap_entries(self, fwd_key: SortKey, bwd_key: SortKey) -> HeapEntries:
        """The heap entries of every id under these keys, made as the scheduler needs them
        (see [Note: heap entries made when needed])."""
        return HeapEntries(self, fwd_key, bwd_key)


class HeapEntries:
    """id -> its heap entry ``key * n + id``: one integer orders by key, then id.

    [Note: heap entries made when needed]
    Half a million entries are half a million integers to make, and a portfolio policy
    that gives up early (:class:`~megatron_prt.core.greedy.Run`) reads few of them. A
    micro-batch's actions are one chain from its source ([Note: implied producers]): the
    scheduler reads an action's entry when its producer finishes, so no entry of a
    micro-batch but its source's is read before that source has started. ``items`` holds
    the entries of the first micro-batches, in id order; :meth:`fill_through` extends it
    (the scheduler calls it when a rank starts an action past it), :meth:`entry` makes the
    sources' entries, :meth:`fill` all of them (what repeating a steady state reads)."""

    def __init__(self, graph: Graph, fwd_key: SortKey, bwd_key: SortKey) -> None:
        self.n, self.width, self.mb_pipeline = graph.n, graph.width, graph.mb_pipeline
        self._by_stage = (fwd_key.by_stage, bwd_key.by_stage)
        self._by_mb = (fwd_key.by_mb, bwd_key.by_mb)
        n, by_stage = self.n, self._by_stage
        # per pipeline, per offset: the by-stage part of the entry (kinds: 2 * stage + op bit)
        self._parts = [
            [by_stage[kind & 1][kind >> 1] * n + j for j, kind in enumerate(kinds)]
            for kinds in graph.kind_templates
        ]
        self._stage_of = graph.stage
        self.items: list[int] = []

    def entry(self, action: int) -> int:
        """One id's entry, whether or not ``items`` holds it yet."""
        op, mb = action & 1, action // self.width
        key = self._by_stage[op][self._stage_of[action]] + self._by_mb[op][mb]
        return key * self.n + action

    def fill_through(self, action: int) -> None:
        """Extend ``items`` to the end of ``action``'s micro-batch."""
        n, width, items, by_mb = self.n, self.width, self.items, self._by_mb
        half = width // 2  # offsets alternate F, B: one (F, B) pair of additions per stage
        for mb in range(len(items) // width, action // width + 1):
            adds = [by_mb[0][mb] * n + mb * width, by_mb[1][mb] * n + mb * width]
            items += map(add, self._parts[self.mb_pipeline[mb]], adds * half)

    def fill(self) -> None:
        """Make every entry."""
        self.fill_through(self.n - 1)


def _tile(templates: Sequence[list], mb_pipeline: tuple[int, ...]) -> list:
    """Per id: the per-offset template of its micro-batch's pipeline, micro-batch after
    micro-batch. When the micro-batches take the pipelines in turn (what
    :func:`~megatron_prt.core.plan.split_microbatches` does) one round's templates are
    repeated (a copy at memory speed, ten times faster than concatenating micro-batches)."""
    pipes = len(templates)
    rounds, extra = divmod(len(mb_pipeline), pipes)
    if mb_pipeline != tuple(mb % pipes for mb in range(len(mb_pipeline))):
        return list(chain.from_iterable(map(templates.__getitem__, mb_pipeline)))
    tiled = [*chain.from_iterable(templates)] * rounds
    tiled += chain.from_iterable(templates[:extra])  # in place: no copy of the whole
    return tiled


@functools.lru_cache(maxsize=8)
def compile_graph(placement: Placement, mb_pipeline: tuple[int, ...]) -> Graph:
    """The shared :class:`Graph` of a configuration (cached: a portfolio and the callers
    comparing plans ask for the same one)."""
    return Graph(placement, mb_pipeline)
