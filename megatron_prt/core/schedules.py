"""Schedule generators: (placement, micro-batches, stage times) -> compute-only :class:`Plan`.

``prt``          PRT for any reuse, placement, direction and m: 1F1B-like list scheduling
                 (bounded warm-up, steady alternation, cool-down) over a small portfolio of
                 policies; the fastest plan under the given stage times wins, ties going to
                 the one holding fewer activations. R=1/uni reproduces 1F1B, R=1/bi is
                 Chimera-style, R>1/loop matches Megatron's interleaved order.
``1f1b``         textbook 1F1B (PipeDream-Flush): R=1, uni.
``interleaved``  megatron-core's virtual-pipeline order, rebuilt from its schedule table
                 (loop, uni, where megatron-core accepts the configuration).
``gpipe``        all forwards, then all backwards (any placement).
``zb``, ``zb-h2`` split backward (F, I, W) for any placement, direction, R and m, under 1F1B's
                 or ZB-H2's activation memory (:mod:`megatron_prt.core.zerobubble`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace
from itertools import product
from operator import add

from .actions import Action, Op
from .gcpause import without_gc
from .greedy import (
    GaveUp,
    IdResult,
    Policy,
    Run,
    SortKey,
    compile_graph,
    compiled_schedule,
    list_schedule,
    oldest_first,
)
from .placement import ConfigError, Placement
from .plan import Plan, split_microbatches, vouch
from .replay import keep_compiled, replay
from .timing import StageTimes
from .zerobubble import zero_bubble

Generator = Callable[[Placement, int, StageTimes], Plan]


# -- warm-up depth (caps) ---------------------------------------------------------------------
def _spans(placement: Placement) -> list[list[tuple[int, int]]]:
    """Per rank, per pipeline: (first, last) flow position of the rank's stages."""
    per_pipeline = []
    for stages in placement.pipelines:
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for position, stage in enumerate(stages):
            rank = placement.stage_to_rank[stage]
            first.setdefault(rank, position)
            last[rank] = position
        per_pipeline.append((first, last))
    return [
        [(firsts[r], lasts[r]) for firsts, lasts in per_pipeline] for r in range(placement.ranks)
    ]


def round_trip_caps(placement: Placement, times: StageTimes) -> tuple[int, ...]:
    """Activations a rank must hold so a steady state has no gap: for each pipeline, the
    forward+backward time from the rank's first stage to the end and back, divided by the
    time the rank spends per micro-batch of each pipeline. Equals 1F1B's ``P - r`` at R=1.
    A rank whose stages take no time (no layers) never causes a gap; it gets the cap equal
    stages would give it."""
    # warm-up: rank r admits ceil( sum over pipelines of sum_{k=first_r..D-1} (F_k + B_k)
    #                             / sum over its stages of (F_k + B_k) ) forwards before its
    # first backward (first_r: flow position of r's first stage in that pipeline; at least 1);
    # R=1 uni with equal stages: ceil(3(P-r) / 3) = P - r, 1F1B's P-1-r plus the first
    # steady forward
    uniform = StageTimes.uniform(placement.depth)
    caps = []
    for rank, span in enumerate(_spans(placement)):
        cap = _round_trip(placement, times, rank, span)
        cap = cap or _round_trip(placement, uniform, rank, span)
        caps.append(max(1, math.ceil(cap - 1e-9)))
    return tuple(caps)


def _round_trip(placement: Placement, times: StageTimes, rank: int, span: list) -> float:
    """Round trip over period for ``rank`` (0 when its stages take no time); ``span``: its
    :func:`_spans`."""

    def both(k: int) -> float:
        return times.fwd[k] + times.bwd[k]

    period = sum(both(placement.model_stage(s)) for s in placement.rank_stages[rank])
    if period <= 0:
        return 0.0
    # the additions of both(k) for k from first to the last stage, in order, in C
    depth = placement.depth
    trip = sum(sum(map(add, times.fwd[first:depth], times.bwd[first:depth])) for first, _ in span)
    return trip / period


def megatron_caps(placement: Placement) -> tuple[int, ...]:
    """megatron-core's interleaved warm-up ``2(P-r-1) + (R-1)P`` plus the first steady
    forward, written in stage positions so it applies to any placement."""
    # warm-up: rank r admits sum over pipelines of (last_r - first_r) + 2(D-1-last_r) + 1
    # forwards before its first backward (first_r/last_r: flow positions of r's first and
    # last stage in that pipeline); loop uni: (R-1)P + 2(P-1-r) + 1, megatron-core's
    # interleaved warm-up plus the first steady forward; wave R=2 uni: 2P on every rank
    d = placement.depth
    return tuple(
        sum(last - first + 2 * (d - 1 - last) + 1 for first, last in span)
        for span in _spans(placement)
    )


# -- forward / backward preference ------------------------------------------------------------
def _keys(placement: Placement, num_microbatches: int, name: str) -> dict[str, SortKey]:
    """The forward and backward keys of a named preference (:class:`Policy` fields). Every
    key ends in (stage, mb), so equal preferences fall back to the lower stage, then the
    older micro-batch."""
    stages, mbs = placement.num_stages, num_microbatches
    if name in ("depth_first", "deepest"):
        # (-stage, mb): push the deepest ready forward on (frees memory sooner)
        deepest = SortKey([(stages - 1 - s) * mbs for s in range(stages)], range(mbs))
        if name == "deepest":  # deepest first both ways: keeps the far end of a wave busy
            return {"fwd_key": deepest, "bwd_key": deepest}
        return {"fwd_key": deepest, "bwd_key": oldest_first(stages, mbs)}
    # "grouped": megatron-core's order: groups of P micro-batches (per pipeline) sweep a
    # pass, then the next pass; a short last group joins the previous one. As integers:
    # (group, pass, mb, stage, mb), backward with the passes reversed.
    width = placement.ranks * placement.num_pipelines
    groups = max(1, num_microbatches // width)
    depth, ranks, reuse = placement.depth, placement.ranks, placement.reuse
    unit_stage, unit_mb = mbs, mbs * stages  # (..., mb, stage, mb): place values
    unit_pass = unit_mb * mbs
    by_mb = [
        min(mb // width, groups - 1) * reuse * unit_pass + mb * unit_mb + mb for mb in range(mbs)
    ]
    passes = [(s % depth) // ranks for s in range(stages)]
    fwd = SortKey([p * unit_pass + s * unit_stage for s, p in enumerate(passes)], by_mb)
    bwd = SortKey(
        [(reuse - 1 - p) * unit_pass + s * unit_stage for s, p in enumerate(passes)], by_mb
    )
    return {"fwd_key": fwd, "bwd_key": bwd}


def makespan_lower_bound(placement: Placement, mb_pipeline, times: StageTimes) -> float:
    """No schedule beats this: for every rank, the earliest its first action can start, plus
    all its work, plus the shortest backward tail that must follow its last action."""
    ticks, tick = times.in_ticks()  # same arithmetic as the schedulers: exact comparisons
    return (
        max(head + work + tail for head, work, tail in _rank_bounds(placement, mb_pipeline, ticks))
        * tick
    )


def _rank_bounds(placement: Placement, mb_pipeline, ticks: StageTimes) -> list[tuple]:
    """Per rank (head, work, tail) of :func:`makespan_lower_bound`, in ``ticks``."""
    counts = [mb_pipeline.count(p) for p in range(placement.num_pipelines)]
    work = [0] * placement.ranks
    head, tail = [math.inf] * placement.ranks, [math.inf] * placement.ranks
    for pipe, stages in enumerate(placement.pipelines):
        if not counts[pipe]:
            continue
        before_fwd = before_bwd = 0  # forward / backward time of the stages before this one
        for stage in stages:
            rank, k = placement.rank_of(stage), placement.model_stage(stage)
            work[rank] += counts[pipe] * (ticks.fwd[k] + ticks.bwd[k])
            head[rank] = min(head[rank], before_fwd)
            tail[rank] = min(tail[rank], before_bwd)
            before_fwd += ticks.fwd[k]
            before_bwd += ticks.bwd[k]
    return list(zip(head, work, tail, strict=True))


# Beyond this many actions only the policies that win most often are tried (keeps P=64,
# R=8, m=512 planning in seconds); below it the whole portfolio runs unless one hits the bound.
LARGE_PLAN_ACTIONS = 20_000


def _portfolio(placement: Placement, times: StageTimes, num_actions: int):
    base = round_trip_caps(placement, times)
    meg = megatron_caps(placement)
    if num_actions > LARGE_PLAN_ACTIONS:
        return [(meg, "grouped", True), (base, "depth_first", False), (None, "deepest", True)]
    # warm-up caps tried, per rank r: round_trip(r), round_trip(r) + 1, max(1, megatron(r) - 1),
    # megatron(r), megatron(r) + 2, unbounded
    cap_sets = [
        base,
        tuple(c + 1 for c in base),
        tuple(max(1, c - 1) for c in meg),
        meg,
        tuple(c + 2 for c in meg),
        None,
    ]
    return product(cap_sets, ("depth_first", "grouped", "deepest"), (False, True))


def prt(placement: Placement, num_microbatches: int, times: StageTimes | None = None) -> Plan:
    """PRT schedule: the best of a policy portfolio, stopping early at the lower bound.

    With message costs or unequal stages the greedy orders can come out worse than the
    orders planned for free messages or equal stages (a hop makes a ready action look late
    and the greedy fills the gap with the wrong one), so those plans compete too, replayed
    under ``times``; ties keep the plan made for ``times``."""
    uniform = StageTimes.uniform(placement.depth)
    times = times or uniform
    best = _prt_portfolio(placement, num_microbatches, times)
    alternatives = []
    if times.p2p or times.p2p_cpu:
        alternatives.append(StageTimes(times.fwd, times.bwd))
    if times.fwd != uniform.fwd or times.bwd != uniform.bwd or times.p2p or times.p2p_cpu:
        alternatives.append(uniform)
    if not alternatives:
        return best
    best_makespan = replay(best, times).makespan
    for other_times in alternatives:
        other = _prt_portfolio(placement, num_microbatches, other_times)
        makespan = replay(other, times).makespan
        if makespan < best_makespan:
            best, best_makespan = other, makespan
    return best


@functools.lru_cache(maxsize=64)  # prt() and callers comparing plans ask for the same ones
def _prt_portfolio(placement: Placement, num_microbatches: int, times: StageTimes) -> Plan:
    """The portfolio's first plan that meets the lower bound; if none does, the fastest
    (ties: fewer activations held, then portfolio order).

    Two passes so that policies are not run to the end for nothing: the first runs each
    policy only while it can still meet the bound (a rank's start plus its remaining work
    plus its tail already past the bound pauses it); the second, needed only if no policy
    met the bound, resumes each policy while it can still beat the best so far."""
    mb_pipeline = split_microbatches(num_microbatches, placement.num_pipelines)
    graph = compile_graph(placement, mb_pipeline)
    ticks, _ = times.in_ticks()
    bounds = _rank_bounds(placement, mb_pipeline, ticks)
    bound = max(head + work + tail for head, work, tail in bounds)
    tails = [0 if tail == math.inf else tail for _, _, tail in bounds]
    policies = [
        Policy(alternate=alternate, caps=caps, **_keys(placement, num_microbatches, key_name))
        for caps, key_name, alternate in _portfolio(placement, times, graph.n)
    ]
    runs = [Run(graph, times, policy, tails) for policy in policies]
    gave_up: dict[int, int] = {}  # policy -> tick at which it could no longer meet the bound
    for k, run in enumerate(runs):
        result = run.run(bound)
        if isinstance(result, GaveUp):
            gave_up[k] = result.at
        elif result.ticks <= bound:
            return _plan(graph, times, num_microbatches, result)
    # none met the bound: the best by (makespan, peak held, portfolio order); those that
    # kept up longest go on first, so the others give up early against them
    best: tuple | None = None
    for k in sorted(range(len(runs)), key=lambda k: -gave_up.get(k, math.inf)):
        result = runs[k].run(None if best is None else best[0])
        if isinstance(result, IdResult):
            score = (result.ticks, max(result.peak_held), k)
            if best is None or score < best[:3]:
                best = (*score, result)
    return _plan(graph, times, num_microbatches, best[3])


def _plan(graph, times: StageTimes, num_microbatches: int, result: IdResult) -> Plan:
    """The plan of ``result``, vouched for (the list scheduler runs every action once, after
    its producers), with its compiled replay made from the graph on first use."""
    orders = result.materialise(graph).orders
    plan = Plan(graph.placement, num_microbatches, orders, "prt", graph.mb_pipeline)
    keep_compiled(plan, functools.partial(compiled_schedule, graph, times, result))
    return vouch(plan)


def gpipe(placement: Placement, num_microbatches: int, times: StageTimes | None = None) -> Plan:
    times = times or StageTimes.uniform(placement.depth)
    mb_pipeline = split_microbatches(num_microbatches, placement.num_pipelines)
    by_mb = oldest_first(placement.num_stages, num_microbatches)  # (mb, stage) both ways
    policy = Policy(flush=True, fwd_key=by_mb, bwd_key=by_mb)
    result = list_schedule(placement, mb_pipeline, times, policy)
    return Plan(placement, num_microbatches, result.orders, "gpipe", mb_pipeline)


def one_f_one_b(
    placement: Placement, num_microbatches: int, times: StageTimes | None = None
) -> Plan:
    """PipeDream-Flush: rank r runs ``P-r-1`` warm-up forwards, then F/B pairs, then the
    remaining backwards."""
    if placement.reuse != 1 or placement.direction != "uni":
        raise ConfigError(
            "schedule 1f1b is the R=1 uni baseline; use --reuse 1 --direction uni, "
            "or --schedule prt for reuse and bi"
        )
    p, m = placement.ranks, num_microbatches
    ranks = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)  # warm-up: rank r runs min(P-1-r, m) forwards first
        acts = [Action(rank, Op.F, mb) for mb in range(warmup)]  # warm-up: nF
        for i in range(m - warmup):  # steady: 1F1B
            acts += [Action(rank, Op.F, warmup + i), Action(rank, Op.B, i)]
        acts += [Action(rank, Op.B, mb) for mb in range(m - warmup, m)]  # cool-down: nB
        ranks.append(tuple(acts))
    return Plan(placement, m, tuple(ranks), "1f1b")


def megatron_schedule_table(
    num_microbatches: int, chunks: int, group: int
) -> list[tuple[int, int]]:
    """megatron-core's ``get_schedule_table``: virtual micro-batch -> (mb, chunk)."""
    table = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table += [(mb, chunk) for chunk in range(chunks) for mb in range(first, last)]
    return table


def interleaved(
    placement: Placement, num_microbatches: int, times: StageTimes | None = None
) -> Plan:
    """megatron-core's interleaved 1F1B (group size P), refusing what megatron-core refuses."""
    p, r, m = placement.ranks, placement.reuse, num_microbatches
    if placement.placement != "loop" or placement.direction != "uni":
        raise ConfigError("schedule interleaved exists for --placement loop --direction uni only")
    if r == 1:
        return replace(one_f_one_b(placement, m), schedule="interleaved")
    if m < p or m % p:  # group size P: megatron-core needs P <= m and m % P in {0} U [P, ..)
        raise ConfigError(
            f"megatron-core's interleaved schedule needs micro-batches to be a multiple of "
            f"--pp {p} (got {m}); use --schedule prt, which takes any m"
        )
    table = megatron_schedule_table(m, r, p)
    total = len(table)
    ranks = []
    for rank in range(p):
        # warm-up: rank r runs min(2(P-1-r) + (R-1)P, m*R) forwards before its first backward
        warmup = min((p - rank - 1) * 2 + (r - 1) * p, total)
        fwd = [Action(chunk * p + rank, Op.F, mb) for mb, chunk in table]
        bwd = [Action((r - 1 - chunk) * p + rank, Op.B, mb) for mb, chunk in table]
        acts = fwd[:warmup]  # warm-up
        for k in range(total - warmup):  # steady: 1F1B over virtual micro-batches
            acts += [fwd[k + warmup], bwd[k]]
        acts += bwd[total - warmup :]  # cool-down
        ranks.append(tuple(acts))
    return Plan(placement, m, tuple(ranks), "interleaved")


SCHEDULES: dict[str, Generator] = {
    "prt": prt,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "gpipe": gpipe,
    "zb": zero_bubble,  # split backward (F/I/W) under 1F1B's activation memory
    "zb-h2": functools.partial(zero_bubble, mem_cap="zb-h2"),
}


@without_gc
def build_plan(
    placement: Placement,
    num_microbatches: int,
    schedule: str = "prt",
    times: StageTimes | None = None,
) -> Plan:
    """Generate a compute-only plan; raises :class:`ConfigError` for bad input."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ConfigError(f"micro-batches must be an integer >= 1, got {num_microbatches!r}")
    split_microbatches(num_microbatches, placement.num_pipelines)  # bi needs m >= 2
    return SCHEDULES[schedule](placement, num_microbatches, times)
