"""The compiled replay of a plan the list scheduler made, from the scheduler's own tables.

:func:`megatron_prt.core.greedy.schedule_ids` schedules integer ids of a
:class:`~megatron_prt.core.graph.Graph`; the plan it keeps holds half a million
:class:`Action` values. Its :class:`~megatron_prt.core.replay.Replayer` (validation,
lowering and simulation share it) comes from the graph's per-id templates and the
scheduler's timeline instead of from those actions (:meth:`Replayer.from_tables`).
"""

from __future__ import annotations

import functools
from collections import deque
from itertools import chain, repeat
from operator import add
from typing import TYPE_CHECKING

from .actions import Action, Op
from .columns import picker
from .deps import producers
from .plan import Plan
from .replay import Replayer, Ticks
from .timing import StageTimes

if TYPE_CHECKING:
    from .graph import Graph
    from .greedy import IdResult


def compiled_schedule(graph: Graph, times: StageTimes, result: IdResult, plan: Plan) -> Replayer:
    """The :class:`~megatron_prt.core.replay.Replayer` of ``plan`` (``result``, scheduled
    under ``times``, materialised) from the graph's tables. The scheduler started every
    action after its producers, so ``result.started`` is a dependency order; and unless a
    forward was forced past its cap every action started as soon as its rank was free and
    its inputs had arrived, so the scheduler's timeline is the replay's under ``times``.
    Made at once: the kinds and that timeline, each a pass in plan order (what lowering
    and a trusted validation read); the graph id -> plan index table (a scatter) and what
    needs it (producers, dependency order, remote producers) only on first use."""
    n, placement = graph.n, graph.placement
    kinds, by_graph_kind, crosses = _kinds(graph)
    per_id = graph.tiled([list(map(by_graph_kind.__getitem__, t)) for t in graph.kind_templates])
    kind_of = _gather(per_id, result.orders)
    lanes = plan.lanes if plan.mb_pipeline == graph.mb_pipeline else None  # Replayer.by_rows

    @functools.cache
    def flat() -> list[int]:  # the plan's ids, ranks concatenated (made when asked)
        return list(chain.from_iterable(result.orders))

    @functools.cache
    def where() -> list[int]:  # graph id -> index in the plan's flat order; n: "no producer";
        out = [n] * (n + 1) + [-1] * (n + 1)  # past n + 1: -1 (a scatter: made when asked)
        deque(map(out.__setitem__, flat(), range(n)), maxlen=0)
        return out

    def remote() -> list[int]:  # the remote producer's id is id + a step per graph kind
        offsets = graph.producer_offsets
        steps = [n + 1 if o < 0 else o - j for pipe in offsets for j, o in enumerate(pipe[2])]
        if lanes is not None:
            return Replayer.by_rows(where(), graph.width, lanes, steps)
        graph_kinds = graph.kinds_of(flat())
        moved = map(add, flat(), map(steps.__getitem__, graph_kinds))
        return list(map(where().__getitem__, moved))

    def gather(ids: list[int]) -> list[int]:  # per action of the plan: where[ids[its id]]
        return list(map(where().__getitem__, map(ids.__getitem__, flat())))

    tables = {
        "actions": lambda: list(chain.from_iterable(plan.ranks)),
        "rank_of": lambda: list(
            chain.from_iterable(repeat(r, len(ids)) for r, ids in enumerate(result.orders))
        ),
        "kinds": kinds,
        "kind_of": kind_of,
        "dep": lambda: [gather(ids) for ids in graph.producer_ids],
        "crosses": lambda: [list(map(flags.__getitem__, kind_of)) for flags in crosses],
        "order": lambda: list(map(where().__getitem__, result.started)),
        "remote": remote,
        "known": {},
    }
    if not result.forced:
        ticks, tick = times.in_ticks()
        busy = [ticks.busy(Action(stage, op, 0), placement) for stage, op in kinds]
        durations = list(map(busy.__getitem__, kind_of))
        ends = list(chain.from_iterable(result.ends))
        tables["known"][ticks, tick] = Ticks(ends, durations, ticks.p2p, tick)
    return Replayer.from_tables(plan, tables)


def _kinds(graph: Graph) -> tuple[list[tuple], list[int], tuple[list[bool], list[bool]]]:
    """The graph's kinds ``(stage, op)`` in :class:`Replayer`'s order; per graph kind
    (``2 * stage + op bit``) its index there; per kind and producer slot whether that edge
    crosses ranks."""
    placement = graph.placement
    kinds = sorted({(graph.stage[i], (Op.F, Op.B)[i & 1]) for i in _kind_ids(graph)})
    by_graph_kind = [0] * (2 * placement.num_stages)
    crosses: tuple[list[bool], list[bool]] = ([], [])
    for k, (stage, op) in enumerate(kinds):
        by_graph_kind[2 * stage + (op is Op.B)] = k
        deps = producers(Action(stage, op, 0), placement)
        for slot in (0, 1):
            crosses[slot].append(
                slot < len(deps)
                and placement.stage_to_rank[deps[slot].stage] != placement.stage_to_rank[stage]
            )
    return kinds, by_graph_kind, crosses


def _gather(table: list, orders: tuple[list[int], ...]) -> list:
    """``table[id]`` of every id of ``orders``, rank after rank (one C-level pick a rank)."""
    out: list = []
    for ids in orders:
        out += picker(ids)(table)
    return out


def _kind_ids(graph: Graph) -> list[int]:
    """One id of every kind (stage, op) the graph holds: the first micro-batch of each
    pipeline it uses."""
    firsts = {pipe: mb for mb, pipe in reversed(list(enumerate(graph.mb_pipeline)))}
    return [mb * graph.width + j for mb in firsts.values() for j in range(graph.width)]
