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
policies runs; the plan under the cap that replays fastest under the given times wins,
ties going to the one holding less (a run's own clock is no judge: a rank its caps hold
back idles there, while the replay starts the same order as early as it can).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
    with first chunks while the micro-batches it holds wait for their later ones).
    ``per_mb``: ``caps`` count micro-batches on the rank (from its first forward there to
    its last I there), not forwards, so a later chunk of one it holds never waits on them."""

    caps: tuple[int, ...] | None = None
    alternate: bool = True
    eager_w: bool = False
    fwd_order: str = "deepest"
    w_resets: bool = False
    reserve: bool = False
    inp_order: str = "oldest"
    per_mb: bool = False


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
    """The F/I/W plan of the portfolio that replays fastest under ``times`` among those
    whose every rank holds at most ``mem_cap``.

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
    bound = split_lower_bound(placement, mb_pipeline, times)
    best, best_key, lowest = None, (math.inf, math.inf), math.inf
    for planning in _planning_times(placement, times):
        for policy in _portfolio(placement, planning):
            result = ZBScheduler(placement, mb_pipeline, planning, act, keep, cap, policy).run()
            peak = max(result.peak_bytes)
            lowest = min(lowest, peak)
            if peak > cap * (1 + 1e-9):
                continue
            plan = Plan(placement, num_microbatches, result.orders, name, mb_pipeline)
            key = (replay(plan, times).makespan, peak)
            if key < best_key:
                best, best_key = plan, key
            if best_key[0] <= bound * (1 + 1e-12):
                return best
    if best is None:
        raise ConfigError(
            f"no split-backward plan for {placement} with m={num_microbatches} fits the "
            f"activation cap {cap:.6g} (the lowest found holds {lowest:.6g}); raise mem_cap "
            "(e.g. 'zb-h2') or the number of micro-batches"
        )
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
    if placement.reuse > 1:  # caps counting micro-batches: later chunks never wait on them
        out += [replace(policy, per_mb=True) for policy in out if policy.caps is not None]
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
    ``(tick, seq, rank, finished action's index or -1 for a wake-up)``, ties in push order,
    so a run is deterministic. If every rank is blocked by its caps alone, the best waiting
    forward runs anyway (the run never deadlocks; its peak then tells the caller). Actions
    are indices into the cached graph's list and per-stage facts are lists (a run makes
    and orders every action once: hashing an :class:`Action` costs more than its work)."""

    def __init__(self, placement, mb_pipeline, times, act, keep, cap, policy: ZBPolicy):
        self.placement, self.policy, self.cap = placement, policy, cap * (1 + 1e-9)
        self.times, self.tick = times.in_ticks()
        self.mb_pipeline = mb_pipeline
        self.group_width = placement.ranks * placement.num_pipelines  # grouped orders
        self.groups = max(1, len(mb_pipeline) // self.group_width)
        model = [placement.model_stage(s) for s in range(placement.num_stages)]
        self.stage_bytes = [act[k] for k in model]
        self.stage_keep = [keep[k] for k in model]
        self.busy = {
            op: [self.times.busy(Action(s, op, 0), placement) for s in range(len(model))]
            for op in (Op.F, Op.I, Op.W)
        }
        # (rank, pipeline) -> (the rank's first stage in it, bytes of all its stages in it)
        self.entry = {}
        for pipe, stages in enumerate(placement.pipelines):
            for rank in range(placement.ranks):
                mine = [s for s in stages if placement.rank_of(s) == rank]
                self.entry[rank, pipe] = (mine[0], sum(self.stage_bytes[s] for s in mine))
        self.actions, self.consumers, counts = _graph(placement, tuple(mb_pipeline))
        self.waiting = list(counts)
        self.ready_at = [0] * len(self.actions)
        self.rank_of = placement.stage_to_rank
        self.ranks = [_Rank([], [], [], []) for _ in range(placement.ranks)]
        self.order: list[list[Action]] = [[] for _ in self.ranks]
        self.events: list = []
        self.seq = 0

    def run(self) -> ZBResult:
        for index, count in enumerate(self.waiting):
            if count == 0:
                self._arrive(index)
        done = now = 0
        events, ranks = self.events, self.ranks
        while done < len(self.actions):
            if not events:  # every rank blocked by its caps alone
                rank = min((s.fwd[0], r) for r, s in enumerate(ranks) if s.fwd and not s.busy)[1]
                self._start(rank, heapq.heappop(ranks[rank].fwd)[1], now)
                continue
            now = events[0][0]
            touched = set()
            while events and events[0][0] == now:
                _, _, rank, index = heapq.heappop(events)
                touched.add(rank)
                if index >= 0:
                    done += 1
                    self._finish(rank, index, now)
            for rank in sorted(touched):
                state = ranks[rank]
                if not state.busy:
                    self._admit(state, now)
                    index = self._pick(state, rank)
                    if index is not None:
                        self._start(rank, index, now)
        orders = tuple(tuple(acts) for acts in self.order)
        return ZBResult(orders, now * self.tick, tuple(s.peak for s in ranks))

    def _admit(self, state: _Rank, now: int) -> None:
        arrivals = state.arrivals
        while arrivals and arrivals[0][0] <= now:
            index = heapq.heappop(arrivals)[2]
            action = self.actions[index]
            op = action.op
            queue = state.fwd if op is Op.F else state.inp if op is Op.I else state.wgt
            heapq.heappush(queue, (self._key(action), index))

    def _key(self, action: Action) -> tuple:
        stage, op, mb = action
        policy = self.policy
        order = policy.fwd_order if op is Op.F else policy.inp_order if op is Op.I else None
        if order == "deepest":
            return (-stage, mb)
        if order == "grouped":
            chunk = (stage % self.placement.depth) // self.placement.ranks
            group = min(mb // self.group_width, self.groups - 1)
            return (group, chunk if op is Op.F else -chunk, mb)
        return (mb, -stage if op is Op.F else stage)

    def _pick(self, state: _Rank, rank: int) -> int | None:
        policy = self.policy
        fwd_ok = False
        if state.fwd:
            forward = self.actions[state.fwd[0][1]]
            fwd_ok = self._fits(state, rank, forward) and (
                policy.caps is None
                or state.ahead < policy.caps[rank]
                or (policy.per_mb and not self._enters(rank, forward))
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

    def _enters(self, rank: int, action: Action) -> bool:
        """Whether ``action`` is on its micro-batch's first stage on ``rank``."""
        return action.stage == self.entry[rank, self.mb_pipeline[action.mb]][0]

    def _fits(self, state: _Rank, rank: int, forward: Action) -> bool:
        need = self.stage_bytes[forward.stage]
        if self.policy.reserve:
            first, chain = self.entry[rank, self.mb_pipeline[forward.mb]]
            need = chain if forward.stage == first else 0.0
            need += state.reserved
        return state.held + need <= self.cap

    def _start(self, rank: int, index: int, now: int) -> None:
        state = self.ranks[rank]
        state.busy = True
        stage, op, mb = action = self.actions[index]
        if op is not Op.W or self.policy.w_resets:  # W may sit inside F, I, F, I
            state.last_was_i = op is Op.I
        if op is Op.F:
            first, chain = self.entry[rank, self.mb_pipeline[mb]]
            size = self.stage_bytes[stage]
            state.reserved += (chain if stage == first else 0.0) - size
            state.held += size
            if state.held > state.peak:
                state.peak = state.held
            state.ahead += not self.policy.per_mb or stage == first
        self.order[rank].append(action)
        self.seq += 1
        heapq.heappush(self.events, (now + self.busy[op][stage], self.seq, rank, index))

    def _finish(self, rank: int, index: int, now: int) -> None:
        state = self.ranks[rank]
        state.busy = False
        stage, op, _ = action = self.actions[index]
        keep = self.stage_keep[stage]
        if op is Op.I:  # frees what only the input gradient needed
            state.held -= (1 - keep) * self.stage_bytes[stage]
            if state.held > state.peak:  # keep > 1: I's output gradients
                state.peak = state.held
            state.ahead -= not self.policy.per_mb or self._enters(rank, action)
        elif op is Op.W:
            state.held -= keep * self.stage_bytes[stage]
        rank_of, ready_at, waiting, hop = self.rank_of, self.ready_at, self.waiting, self.times.p2p
        for nxt, nxt_stage in self.consumers[index]:
            at = now + hop if rank_of[nxt_stage] != rank else now
            if at > ready_at[nxt]:
                ready_at[nxt] = at
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                self._arrive(nxt)

    def _arrive(self, index: int) -> None:
        stage, _, mb = self.actions[index]
        rank = self.rank_of[stage]
        at = self.ready_at[index]
        heapq.heappush(self.ranks[rank].arrivals, (at, (mb, stage), index))
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, rank, -1))


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
    """The actions, per action the ``(index, stage)`` of its consumers, and how many
    producers each waits for (read-only)."""
    actions = split_actions(placement, mb_pipeline)
    index = {a: i for i, a in enumerate(actions)}
    consumers = consumers_map(actions, placement, split=True)
    users = [tuple((index[c], c.stage) for c in consumers[a]) for a in actions]
    counts = [len(producers(a, placement, split=True)) for a in actions]
    return actions, users, counts
