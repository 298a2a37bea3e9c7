"""Split-backward (zero-bubble) plans: F, I and W for every placement, direction, R and m.

The backward of a stage is split into I (the input gradient, which the stage upstream waits
for) and W (the weight gradient, which nothing waits for but the optimizer step). A rank
that would idle runs a deferred W instead, so W fills the bubbles of a 1F1B-like order
(ZB-H1/H2, ZB-V in Qi et al., "Zero Bubble Pipeline Parallelism", 2023). Deferring W costs
memory: what W needs (the inputs and output gradients of the weight GEMMs, a share
``keep`` of the stage's activation) stays until W runs. docs/theory.md, section 8, gives
the memory model and the lower bound.

:func:`zero_bubble` is list scheduling in time, as :mod:`megatron_prt.core.greedy` does for
F/B, with one more rule: a forward may start only while the rank's activation bytes stay
under a per-rank cap (default: what plain 1F1B holds on its busiest rank). Priorities: a
ready I first (it is on the critical path), then a forward the caps admit, then W (the
filler; W also frees the memory a blocked forward waits for). A small portfolio of
policies runs; the fastest plan under the cap wins, ties going to the one holding less.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product

from .actions import Action, Op
from .deps import consumers_map, producers
from .placement import ConfigError, Placement
from .plan import Plan, split_microbatches
from .replay import replay
from .timing import StageTimes

# Share of a stage's activation bytes that W still needs after I (the rest I frees). A
# transformer layer keeps 34·s·b·h bytes for backward (fp16, flash attention; Korthikanti et
# al. 2022); W needs the inputs of its four weight GEMMs (2+2+2+8 = 14·sbh) and their output
# gradients, made by I (6+2+8+2 = 18·sbh): 32/34. The profiler may measure it instead.
WGRAD_KEEP_FRACTION = 32 / 34

MEM_CAPS = ("1f1b", "zb-h2")


def one_f_one_b_peak(num_ranks: int, num_microbatches: int, act: Sequence[float]) -> float:
    """Activation bytes plain 1F1B holds on its busiest rank: rank ``r`` holds
    ``min(m, P - r)`` micro-batches of its stage (docs/theory.md, sec. 2), whose bytes are
    those of the model stages ``act[r*D/P : (r+1)*D/P]`` when ``len(act)`` is a multiple
    ``D`` of ``P``, else equal shares of ``sum(act)`` (then rank 0 is the busiest)."""
    p, m = num_ranks, num_microbatches
    if len(act) % p:
        return min(m, p) * sum(act) / p
    per = len(act) // p
    return max(min(m, p - r) * sum(act[r * per : (r + 1) * per]) for r in range(p))


def resolve_mem_cap(
    mem_cap: str | float, placement: Placement, num_microbatches: int, act: Sequence[float]
) -> float:
    """Per-rank activation-byte cap: ``"1f1b"`` (1F1B's peak), ``"zb-h2"`` (ZB-H2's
    ``min(m, 2P-1)`` shares, about twice 1F1B's) or a number of bytes."""
    p, m = placement.ranks, num_microbatches
    if mem_cap == "1f1b":
        return one_f_one_b_peak(p, m, act)
    if mem_cap == "zb-h2":
        return min(m, 2 * p - 1) * sum(act) / p
    if isinstance(mem_cap, (int, float)) and not isinstance(mem_cap, bool) and mem_cap > 0:
        return float(mem_cap)
    raise ConfigError(
        f"mem_cap must be one of {', '.join(MEM_CAPS)} or a number of bytes > 0, got {mem_cap!r}"
    )


@dataclass(frozen=True)
class ZBPolicy:
    """``caps[r]``: most forwards rank ``r`` runs ahead of their I (None: only memory bounds
    it). ``alternate``: after an I prefer a forward (1F1B's steady state); ``w_resets``: a W
    ends the alternation (after it, I first). ``eager_w``: W before forwards (no deferral:
    1F1B's memory). ``fwd_order``: which ready forward first: ``deepest`` stage,
    ``oldest`` micro-batch, or ``grouped`` (megatron-core's order: groups of P micro-batches
    sweep a chunk, then the next chunk); ``inp_order``: which ready I first, ``oldest`` or
    ``grouped`` (the group's last chunk first). ``reserve``: a micro-batch enters a rank
    only if the cap leaves room for all of its stages there (tight caps: no rank fills up
    with first chunks while the micro-batches it holds wait for their later ones)."""

    caps: tuple[int, ...] | None = None
    alternate: bool = True
    eager_w: bool = False
    fwd_order: str = "deepest"
    w_resets: bool = False
    reserve: bool = False
    inp_order: str = "oldest"


@dataclass(frozen=True)
class ZBResult:
    orders: tuple[tuple[Action, ...], ...]
    makespan: float
    peak_bytes: tuple[float, ...]  # rank -> most activation bytes held at once


def zero_bubble(
    placement: Placement,
    num_microbatches: int,
    times: StageTimes | None = None,
    *,
    mem_cap: str | float = "1f1b",
    act: Sequence[float] | None = None,
    keep: float | Sequence[float] = WGRAD_KEEP_FRACTION,
) -> Plan:
    """The fastest F/I/W plan of the portfolio whose every rank holds at most ``mem_cap``.

    ``act[k]``: activation bytes of model stage ``k`` for one micro-batch (default: 1/D
    each, so one micro-batch through the whole model is 1); ``keep``: the share of a
    stage's ``act`` that W needs until it runs, one for all stages or one per model stage
    (above 1 where W's operands outweigh what the forward saved). Raises
    :class:`ConfigError` if no policy fits under the cap.

    As for :func:`megatron_prt.core.schedules.prt`, with message times or unequal stages the
    plans made for free messages and equal stages (same W share) compete too, replayed under
    ``times`` (a hop makes a ready action look late and the greedy fills the gap wrongly);
    a rank's memory depends only on its order, so every candidate stays under the cap."""
    times = times or StageTimes.uniform(placement.depth)
    depth = placement.depth
    act = tuple(act) if act is not None else (1.0 / depth,) * depth
    keep = (keep,) * depth if isinstance(keep, (int, float)) else tuple(keep)
    if len(act) != depth or len(keep) != depth or not all(k >= 0 for k in keep):
        raise ConfigError(
            f"act needs {depth} stage sizes and keep one share >= 0 (or {depth}), "
            f"got act {act} and keep {keep}"
        )
    cap = resolve_mem_cap(mem_cap, placement, num_microbatches, act)
    mb_pipeline = split_microbatches(num_microbatches, placement.num_pipelines)
    name = "zb-h2" if mem_cap == "zb-h2" else "zb"
    best, best_makespan = None, math.inf
    for planning in _planning_times(placement, times):
        orders = _best_orders(placement, mb_pipeline, planning, act, keep, cap)
        plan = Plan(placement, num_microbatches, orders, name, mb_pipeline)
        makespan = replay(plan, times).makespan
        if makespan < best_makespan:
            best, best_makespan = plan, makespan
    return best


def _planning_times(placement: Placement, times: StageTimes) -> list[StageTimes]:
    """``times``, then the same without message times, then equal stages with the same
    overall W share."""
    out = [times]
    if times.p2p or times.p2p_cpu:
        out.append(StageTimes(times.fwd, times.bwd, wgt=times.wgt))
    bwd = sum(times.bwd)
    share = sum(times.wgrad(k) for k in range(placement.depth)) / bwd if bwd else 0.5
    uniform = StageTimes.uniform(placement.depth).with_wgrad_fraction(share)
    if (times.fwd, times.bwd, times.p2p, times.p2p_cpu) != (uniform.fwd, uniform.bwd, 0, 0):
        out.append(uniform)
    return out


def _best_orders(placement, mb_pipeline, times, act, keep, cap):
    """The portfolio under ``times``: the fastest orders under ``cap`` (ties: less held)."""
    bound = split_lower_bound(placement, mb_pipeline, times)
    best, lowest = None, math.inf
    for policy in _portfolio(placement, times):
        result = ZBScheduler(placement, mb_pipeline, times, act, keep, cap, policy).run()
        peak = max(result.peak_bytes)
        lowest = min(lowest, peak)
        if peak > cap * (1 + 1e-9):
            continue
        if best is None or (result.makespan, peak) < (best.makespan, max(best.peak_bytes)):
            best = result
        if best.makespan <= bound * (1 + 1e-12):
            break
    if best is None:
        raise ConfigError(
            f"no split-backward plan for {placement} with m={len(mb_pipeline)} fits the "
            f"activation cap {cap:.6g} (the lowest found holds {lowest:.6g}); raise mem_cap "
            "(e.g. 'zb-h2') or the number of micro-batches"
        )
    return best.orders


def split_lower_bound(placement: Placement, mb_pipeline: Sequence[int], times: StageTimes) -> float:
    """No F/I/W schedule beats this: every rank's earliest start plus all its work (a W can
    be its last action, so no tail is forced), and one micro-batch's forward chain, input-
    gradient chain and the first stage's W (docs/theory.md, section 8)."""
    counts = [mb_pipeline.count(p) for p in range(placement.num_pipelines)]

    def stage_time(stage: int, op: Op) -> float:
        return times.duration(Action(placement.model_stage(stage), op, 0))

    best = 0.0
    for rank in range(placement.ranks):
        work, head = 0.0, math.inf
        for pipe, stages in enumerate(placement.pipelines):
            for pos, stage in enumerate(stages):
                if counts[pipe] and placement.rank_of(stage) == rank:
                    work += counts[pipe] * sum(stage_time(stage, op) for op in (Op.F, Op.I, Op.W))
                    head = min(head, sum(stage_time(s, Op.F) for s in stages[:pos]))
        best = max(best, (head if work else 0.0) + work)
    for pipe, stages in enumerate(placement.pipelines):
        if counts[pipe]:
            chain = sum(stage_time(s, Op.F) + stage_time(s, Op.I) for s in stages)
            best = max(best, chain + stage_time(stages[0], Op.W))
    return best


def _portfolio(placement: Placement, times: StageTimes) -> list[ZBPolicy]:
    trip = _round_trip_caps(placement, times)
    steady = ((True, False), (False, False), (True, True))  # (alternate, w_resets)
    out = [
        ZBPolicy(caps, alternate, False, fwd, w_resets)
        for caps, fwd, (alternate, w_resets) in product(
            (trip, None, tuple(c + 1 for c in trip)), ("deepest", "oldest"), steady
        )
    ]
    # W right after I at the 1F1B warm-up: 1F1B's memory, the plan that fits any cap that
    # 1F1B fits; then room reserved for a micro-batch's later chunks, for tighter caps
    out.append(ZBPolicy(trip, True, True))
    out += [ZBPolicy(trip, True, eager, reserve=True) for eager in (False, True)]
    # megatron-core's grouped order, for forwards or for input gradients (deep loops at m=2P)
    for (fwd, inp), caps, (alternate, w_resets) in product(
        (("grouped", "oldest"), ("deepest", "grouped")), (trip, None), steady
    ):
        out.append(ZBPolicy(caps, alternate, False, fwd, w_resets, inp_order=inp))
    return out


def _round_trip_caps(placement: Placement, times: StageTimes) -> tuple[int, ...]:
    """Forwards rank ``r`` runs ahead of their I so the first I comes back before it runs
    dry: per pipeline, the F and I time from its first stage to the end and back, over its
    F and I time per micro-batch (``P - r`` at R=1, as 1F1B's warm-up plus one)."""
    caps = []
    for rank in range(placement.ranks):
        mine = [placement.model_stage(s) for s in placement.rank_stages[rank]]
        period = sum(times.fwd[k] + times.duration(Action(k, Op.I, 0)) for k in mine)
        trip = 0.0
        for stages in placement.pipelines:
            first = min(i for i, s in enumerate(stages) if placement.rank_of(s) == rank)
            for s in stages[first:]:
                k = placement.model_stage(s)
                trip += times.fwd[k] + times.duration(Action(k, Op.I, 0))
        caps.append(max(1, math.ceil(trip / period - 1e-9)) if period > 0 else len(mine))
    return tuple(caps)


@dataclass
class _Rank:
    arrivals: list  # heap of (ready tick, key, action)
    fwd: list  # heap of (key, action)
    inp: list  # ready I: heap of (key, action)
    wgt: list  # ready W: heap of (key, action)
    held: float = 0.0  # activation bytes
    reserved: float = 0.0  # bytes of the later stages of micro-batches it has started
    peak: float = 0.0
    ahead: int = 0  # forwards started whose I has not finished
    last_was_i: bool = False
    busy: bool = False


class ZBScheduler:
    """One list-scheduling run of every F, I and W in integer ticks. Events are
    ``(tick, seq, rank, finished action or None for a wake-up)``, ties in push order, so a
    run is deterministic. If every rank is blocked by its caps alone, the best waiting
    forward runs anyway (the run never deadlocks; its peak then tells the caller)."""

    def __init__(self, placement, mb_pipeline, times, act, keep, cap, policy: ZBPolicy):
        self.placement, self.policy, self.cap, self.keep = placement, policy, cap, keep
        self.times, self.tick = times.in_ticks()
        self.act = act
        self.mb_pipeline = mb_pipeline
        self.group_width = placement.ranks * placement.num_pipelines  # grouped orders
        self.groups = max(1, len(mb_pipeline) // self.group_width)
        # (rank, pipeline) -> (the rank's first stage in it, bytes of all its stages in it)
        self.entry = {}
        for pipe, stages in enumerate(placement.pipelines):
            for rank in range(placement.ranks):
                mine = [s for s in stages if placement.rank_of(s) == rank]
                self.entry[rank, pipe] = (
                    mine[0],
                    sum(self._bytes(Action(s, Op.F, 0)) for s in mine),
                )
        self.actions, self.consumers, counts = _graph(placement, tuple(mb_pipeline))
        self.waiting = dict(counts)
        self.ready_at = dict.fromkeys(self.actions, 0)
        self.rank_of = placement.stage_to_rank
        self.ranks = [_Rank([], [], [], []) for _ in range(placement.ranks)]
        self.order: list[list[Action]] = [[] for _ in self.ranks]
        self.events: list = []
        self.seq = 0

    def _bytes(self, action: Action) -> float:
        return self.act[self.placement.model_stage(action.stage)]

    def run(self) -> ZBResult:
        for action in self.actions:
            if self.waiting[action] == 0:
                self._arrive(action)
        done = now = 0
        while done < len(self.actions):
            if not self.events:  # every rank blocked by its caps alone
                rank = min((s.fwd[0], r) for r, s in enumerate(self.ranks) if s.fwd and not s.busy)[
                    1
                ]
                self._start(rank, heapq.heappop(self.ranks[rank].fwd)[1], now)
                continue
            now = self.events[0][0]
            touched = set()
            while self.events and self.events[0][0] == now:
                _, _, rank, action = heapq.heappop(self.events)
                touched.add(rank)
                if action is not None:
                    done += 1
                    self._finish(rank, action, now)
            for rank in sorted(touched):
                state = self.ranks[rank]
                if not state.busy:
                    self._admit(state, now)
                    action = self._pick(state, rank)
                    if action is not None:
                        self._start(rank, action, now)
        orders = tuple(tuple(acts) for acts in self.order)
        return ZBResult(orders, now * self.tick, tuple(s.peak for s in self.ranks))

    def _admit(self, state: _Rank, now: int) -> None:
        while state.arrivals and state.arrivals[0][0] <= now:
            action = heapq.heappop(state.arrivals)[2]
            queue = {Op.F: state.fwd, Op.I: state.inp, Op.W: state.wgt}[action.op]
            heapq.heappush(queue, (self._key(action), action))

    def _key(self, action: Action) -> tuple:
        order = {Op.F: self.policy.fwd_order, Op.I: self.policy.inp_order}.get(action.op)
        if order == "deepest":
            return (-action.stage, action.mb)
        if order == "grouped":
            chunk = (action.stage % self.placement.depth) // self.placement.ranks
            group = min(action.mb // self.group_width, self.groups - 1)
            return (group, chunk if action.op is Op.F else -chunk, action.mb)
        return (action.mb, -action.stage if action.op is Op.F else action.stage)

    def _pick(self, state: _Rank, rank: int) -> Action | None:
        policy = self.policy
        fwd_ok = (
            bool(state.fwd)
            and self._fits(state, rank, state.fwd[0][1])
            and (policy.caps is None or state.ahead < policy.caps[rank])
        )
        if state.inp and not (fwd_ok and policy.alternate and state.last_was_i):
            return heapq.heappop(state.inp)[1]
        if state.wgt and policy.eager_w:
            return heapq.heappop(state.wgt)[1]
        if fwd_ok:
            return heapq.heappop(state.fwd)[1]
        if state.wgt:
            return heapq.heappop(state.wgt)[1]
        return None

    def _fits(self, state: _Rank, rank: int, forward: Action) -> bool:
        need = self._bytes(forward)
        if self.policy.reserve:
            first, chain = self.entry[rank, self.mb_pipeline[forward.mb]]
            need = chain if forward.stage == first else 0.0
            need += state.reserved
        return state.held + need <= self.cap * (1 + 1e-9)

    def _start(self, rank: int, action: Action, now: int) -> None:
        state = self.ranks[rank]
        state.busy = True
        if action.op is not Op.W or self.policy.w_resets:  # W may sit inside F, I, F, I
            state.last_was_i = action.op is Op.I
        if action.op is Op.F:
            first, chain = self.entry[rank, self.mb_pipeline[action.mb]]
            state.reserved += (chain if action.stage == first else 0.0) - self._bytes(action)
            state.held += self._bytes(action)
            state.peak = max(state.peak, state.held)
            state.ahead += 1
        self.order[rank].append(action)
        self.seq += 1
        end = now + self.times.busy(action, self.placement)
        heapq.heappush(self.events, (end, self.seq, rank, action))

    def _finish(self, rank: int, action: Action, now: int) -> None:
        state = self.ranks[rank]
        state.busy = False
        keep = self.keep[self.placement.model_stage(action.stage)]
        if action.op is Op.I:  # frees what only the input gradient needed
            state.held -= (1 - keep) * self._bytes(action)
            state.peak = max(state.peak, state.held)  # keep > 1: I's output gradients
            state.ahead -= 1
        elif action.op is Op.W:
            state.held -= keep * self._bytes(action)
        for nxt in self.consumers[action]:
            hop = self.times.p2p if self.rank_of[nxt.stage] != rank else 0
            self.ready_at[nxt] = max(self.ready_at[nxt], now + hop)
            self.waiting[nxt] -= 1
            if self.waiting[nxt] == 0:
                self._arrive(nxt)

    def _arrive(self, action: Action) -> None:
        rank = self.rank_of[action.stage]
        at = self.ready_at[action]
        heapq.heappush(self.ranks[rank].arrivals, (at, (action.mb, action.stage), action))
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, rank, None))


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
def _graph(placement: Placement, mb_pipeline: tuple[int, ...]):
    """The actions, their consumers and how many producers each waits for (read-only)."""
    actions = split_actions(placement, mb_pipeline)
    consumers = consumers_map(actions, placement, split=True)
    counts = {a: len(producers(a, placement, split=True)) for a in actions}
    return actions, consumers, counts
