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
back idles there, while the replay starts the same order as early as it can). Each run is
replayed as it is made and stops once it can neither win nor tie ([Note: judging a run as
it is made] in :mod:`megatron_prt.core.zbgraph`).

[Note: runs that differ only in caps]
A run's caps act only through its cap tests (``ZBScheduler._admits``), each made with the
rank's counts: ``ahead`` (forwards started, their I not finished) and ``mbs_ahead``
(micro-batches entered, their last I there not finished), kept whatever the caps. By
induction over the choices, a policy equal but for ``caps`` and ``per_mb`` whose tests
would answer every test of a traced run as it was answered makes the same choices: the
same orders and peaks. A trace keeps per rank the largest count a test admitted and the
smallest it stopped (``mbs_ahead``: entering forwards only; ``per_mb`` admits the others,
so a trace with one of those stopped repeats no ``per_mb`` policy); :func:`_repeats`
compares the caps (None: infinity) with them. So a cap that never stopped a forward, its
``+1``, uncapped and ``per_mb`` copies are one run. ``_step`` tests the caps only where
the choice turns on them, so no test whose answer could not matter narrows a trace. The
same induction covers ``fwd_order`` "oldest" against a "deepest" run where at every look
at the first ready forward both orders find one that fits and enters alike and start the
same one (``oldest_too``), and ``reserve`` where every memory test answers alike with it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import product

from .actions import Action, Op
from .placement import ConfigError, Placement
from .plan import Plan, split_microbatches
from .timing import StageTimes
from .zbgraph import Judge, action_facts, busy_ticks, graph, queue_keys

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
    shares = _rank_shares(num_ranks, act)
    return max(min(num_microbatches, num_ranks - r) * share for r, share in enumerate(shares))


def _rank_shares(num_ranks: int, act: Sequence[float]) -> list[float]:
    """Activation bytes of one micro-batch on each rank of an R = 1 pipeline: the model
    stages ``act[r*D/P : (r+1)*D/P]`` when ``len(act)`` is a multiple ``D`` of ``P``, else
    equal shares of ``sum(act)``."""
    p = num_ranks
    if len(act) % p:
        return [sum(act) / p] * p
    per = len(act) // p
    return [sum(act[r * per : (r + 1) * per]) for r in range(p)]


def resolve_mem_cap(
    mem_cap: str | float, placement: Placement, num_microbatches: int, act: Sequence[float]
) -> float:
    """Per-rank activation-byte cap: ``"1f1b"`` (1F1B's peak), ``"zb-h2"`` (ZB-H2's
    ``min(m, 2P-1)`` micro-batches of the largest rank share (:func:`_rank_shares`), about
    twice 1F1B's, and never below it) or a number of bytes."""
    p, m = placement.ranks, num_microbatches
    if mem_cap == "1f1b":
        return one_f_one_b_peak(p, m, act)
    if mem_cap == "zb-h2":  # ZB-H2's peak on its busiest rank: never below 1F1B's, since
        return min(m, 2 * p - 1) * max(_rank_shares(p, act))  # min(m, 2P-1) >= min(m, P-r)
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
    cap_trace: tuple[tuple, ...]  # rank -> what its cap tests saw (_Rank.trace)
    oldest_too: bool  # fwd_order "deepest": "oldest" would have made the same run
    reserve_too: bool  # not ``reserve``: ``reserve`` would have made the same run
    # the judge's replay makespan in its ticks (None: no judge; math.inf: stopped past its
    # limit, the orders, peaks and ``makespan`` (the run's clock then) cut short; the trace
    # and the two flags hold for what ran)
    replayed_ticks: int | float | None = None


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
    judge = Judge.of(placement, mb_pipeline, times)
    limit = [math.inf]  # the best replay so far, in the judge's ticks: runs past it stop
    for planning in _planning_times(placement, times):
        runs = _distinct_runs(placement, mb_pipeline, planning, act, keep, cap, judge, limit)
        for result in runs:
            if result.replayed_ticks == math.inf:  # stopped: can neither win nor tie
                continue
            peak = max(result.peak_bytes)
            lowest = min(lowest, peak)
            if peak > cap * (1 + 1e-9):
                continue
            key = (result.replayed_ticks * judge.tick, peak)  # replay(plan, times).makespan
            if key < best_key:
                best_key, limit[0] = key, result.replayed_ticks
                best = Plan(placement, num_microbatches, result.orders, name, mb_pipeline)
            if best_key[0] <= bound * (1 + 1e-12):
                return best
    if best is None:
        shape = f"{placement.placement}/{placement.direction}"
        where = f"P={placement.ranks} R={placement.reuse} {shape}"
        raise ConfigError(
            f"no split-backward plan for {where} with m={num_microbatches} fits the "
            f"activation cap of {cap:,.0f} bytes per rank (the lowest found holds "
            f"{lowest:,.0f}); raise the cap (--mem-cap, or mem_cap=, e.g. 'zb-h2')"
            + (" or the number of micro-batches" if isinstance(mem_cap, str) else "")
        )
    return best


def _distinct_runs(placement, mb_pipeline, planning, act, keep, cap, judge, limit):
    """The runs of the portfolio under ``planning``, in portfolio order, less those of
    policies whose run would repeat one already made (see [Note: runs that differ only in
    caps]): the same orders and peaks, so the same replay, and an equal key never wins.
    Each run is judged as it is made and stops past ``limit[0]`` ticks (read at its start;
    [Note: judging a run as it is made]); a stopped run repeats, up to where it stopped,
    in any policy its trace says repeats it, which would stop there too (limits only fall)."""
    made: list[tuple[ZBPolicy, ZBResult]] = []
    for policy in _portfolio(placement, planning):
        if any(_repeats(earlier, result, policy) for earlier, result in made):
            continue
        scheduler = ZBScheduler(placement, mb_pipeline, planning, act, keep, cap, policy, judge)
        result = scheduler.run(limit[0])
        made.append((policy, result))
        yield result


def _repeats(earlier: ZBPolicy, result: ZBResult, policy: ZBPolicy) -> bool:
    """Whether ``policy``'s run repeats ``result``, the run of ``earlier`` (same times,
    bytes and cap): the two differ at most in ``caps`` and ``per_mb``, and in one of
    ``fwd_order`` and ``reserve`` where ``result`` says that made no difference, and
    ``policy``'s caps answer every cap test of the run as it was answered."""
    steady = ("alternate", "eager_w", "w_resets", "inp_order")
    if any(getattr(earlier, name) != getattr(policy, name) for name in steady):
        return False
    other_order = earlier.fwd_order != policy.fwd_order
    if other_order and not (result.oldest_too and policy.fwd_order == "oldest"):
        return False
    other_reserve = earlier.reserve != policy.reserve
    if other_reserve and (other_order or not result.reserve_too):
        return False
    for rank, trace in enumerate(result.cap_trace):
        passed, stopped, passed_mbs, stopped_mbs, stopped_inside = trace
        cap = math.inf if policy.caps is None else policy.caps[rank]
        if policy.per_mb and policy.caps is not None:
            if stopped_inside or not passed_mbs < cap <= stopped_mbs:
                return False
        elif not passed < cap <= stopped:
            return False
    return True


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


@dataclass(slots=True)
class _Rank:
    queues: tuple  # ready F, I and W: heaps of (key, action's index)
    held: float = 0.0  # activation bytes
    reserved: float = 0.0  # bytes of the later stages of micro-batches it has started
    peak: float = 0.0
    ahead: int = 0  # forwards started whose I has not finished
    mbs_ahead: int = 0  # micro-batches entered whose last I here has not finished
    last_was_i: bool = False
    busy: bool = False
    # the cap tests: most ``ahead`` / ``mbs_ahead`` (entering forwards only) a test admitted,
    # least one stopped, and whether a forward inside a micro-batch was stopped
    passed: float = -1
    stopped: float = math.inf
    passed_mbs: float = -1
    stopped_mbs: float = math.inf
    stopped_inside: bool = False

    def trace(self) -> tuple:
        return (self.passed, self.stopped, self.passed_mbs, self.stopped_mbs, self.stopped_inside)


_F, _I, _W = range(3)  # an action's kind: the index of its ready queue


class ZBScheduler:
    """One list-scheduling run of every F, I and W in integer ticks. Events are
    ``(tick, code, rank)``: ``code`` is a finished action's index, or ``-1 - index`` for an
    action that becomes ready then. Nothing within a tick depends on the order its events
    are handled in or its idle ranks pick in (each rank's state changes only by its own
    events and picks; a rank picks after every event of the tick), so a run is
    deterministic. If every rank is blocked by its caps alone, the best waiting forward
    runs anyway (never a deadlock; its peak tells the caller). Actions are indices into
    the cached graph's lists (hashing an :class:`Action` costs more than its work)."""

    def __init__(self, placement, mb_pipeline, times, act, keep, cap, policy: ZBPolicy, judge=None):
        self.placement, self.policy, self.cap = placement, policy, cap * (1 + 1e-9)
        self.times, self.tick = times.in_ticks()
        model = [placement.model_stage(s) for s in range(placement.num_stages)]
        self.stage_bytes = [act[k] for k in model]
        self.stage_keep = [keep[k] for k in model]
        self.busy = busy_ticks(placement, self.times)
        tables = graph(placement, tuple(mb_pipeline))
        self.actions, self.consumers, self.counts, self.enters, self.kinds = tables
        self.size, self.duration, self.chain = action_facts(
            placement, tuple(mb_pipeline), tuple(self.stage_bytes), self.busy
        )
        self.keys = queue_keys(placement, tuple(mb_pipeline), policy.fwd_order, policy.inp_order)
        self.rank_of = placement.stage_to_rank
        self.ranks = [_Rank(([], [], [])) for _ in range(placement.ranks)]
        self.order: list[list[Action]] = [[] for _ in self.ranks]
        self.events: list = []
        # fwd_order "deepest": whether "oldest" finds the same first forward at every look
        # (the run's only use of the order), kept in a second heap per rank
        self.watch = self.oldest_too = policy.fwd_order == "deepest"
        self.reserve_too = not policy.reserve  # every memory test answers alike with it
        self.oldest_keys = queue_keys(placement, tuple(mb_pipeline), "oldest", "oldest")
        self.oldest, self.started = [[] for _ in self.ranks], [False] * len(self.actions)
        # the judge's replay so far: per action its end, per rank its last end and work left
        self.judge, self.limit = judge, math.inf
        if judge is not None:
            self.replay_end = [0] * len(self.actions)
            self.replay_free, self.replay_left = [0] * placement.ranks, list(judge.work)

    def run(self, limit: float = math.inf) -> ZBResult:
        """The run; with a judge, stopped once its replay must end past ``limit`` ticks
        ([Note: judging a run as it is made])."""
        self.limit = limit
        try:
            return self._run()
        except _PastLimitError:
            return self._result(math.inf)

    def _result(self, replayed_ticks) -> ZBResult:
        orders, peaks = tuple(map(tuple, self.order)), tuple(s.peak for s in self.ranks)
        traces = tuple(s.trace() for s in self.ranks)
        makespan = self.now * self.tick
        flags = (self.oldest_too, self.reserve_too)
        return ZBResult(orders, makespan, peaks, traces, *flags, replayed_ticks)

    def _run(self) -> ZBResult:
        """The run; ``_finish`` and the arrivals are inlined (the loop runs once per action,
        where a method call costs as much as the work), hence the length."""
        actions, consumers, keys, kinds = self.actions, self.consumers, self.keys, self.kinds
        rank_of, hop, ranks, events = self.rank_of, self.times.p2p, self.ranks, self.events
        cut_hop = self.times.cut_hop if self.times.per_cut else None
        stage_bytes, stage_keep, enters = self.stage_bytes, self.stage_keep, self.enters
        waiting, ready_at = list(self.counts), [0] * len(actions)
        push, pop = heapq.heappush, heapq.heappop
        watch, oldest, oldest_keys = self.watch, self.oldest, self.oldest_keys
        for index, count in enumerate(waiting):
            if count == 0:
                push(events, (0, -1 - index, rank_of[actions[index].stage]))
        done = self.now = now = 0
        while done < len(actions):
            if not events:  # every rank blocked by its caps alone
                self._start_blocked(now)
                continue
            self.now = now = events[0][0]
            touched = set()
            while events and events[0][0] == now:
                _, index, rank = pop(events)
                touched.add(rank)
                if index < 0:  # ready now
                    index = -1 - index
                    push(ranks[rank].queues[kinds[index]], (keys[index], index))
                    if watch and kinds[index] == _F:
                        push(oldest[rank], (oldest_keys[index], index))
                    continue
                done += 1
                state = ranks[rank]
                state.busy = False
                kind, stage = kinds[index], actions[index].stage
                if kind == _I:  # frees what only the input gradient needed
                    state.held -= (1 - stage_keep[stage]) * stage_bytes[stage]
                    if state.held > state.peak:  # keep > 1: I's output gradients
                        state.peak = state.held
                    state.ahead -= 1
                    state.mbs_ahead -= enters[index]
                elif kind == _W:
                    state.held -= stage_keep[stage] * stage_bytes[stage]
                for nxt, nxt_stage in consumers[index]:
                    nxt_rank = rank_of[nxt_stage]
                    if nxt_rank == rank:
                        at = now
                    else:
                        at = now + (hop if cut_hop is None else cut_hop(stage, nxt_stage))
                    if at > ready_at[nxt]:
                        ready_at[nxt] = at
                    waiting[nxt] -= 1
                    if waiting[nxt] == 0:
                        if ready_at[nxt] == now:  # ready at once: no event needed
                            push(ranks[nxt_rank].queues[kinds[nxt]], (keys[nxt], nxt))
                            if watch and kinds[nxt] == _F:
                                push(oldest[nxt_rank], (oldest_keys[nxt], nxt))
                            touched.add(nxt_rank)
                        else:
                            push(events, (ready_at[nxt], -1 - nxt, nxt_rank))
            for rank in touched:
                state = ranks[rank]
                if not state.busy:
                    self._step(rank, now)
        return self._result(None if self.judge is None else max(self.replay_free))

    def _start_blocked(self, now: int) -> None:
        """Every rank is blocked by its caps alone: start the best waiting forward (by the
        queue keys, across ranks; "oldest" must pick the same rank)."""
        idle = [r for r, s in enumerate(self.ranks) if s.queues[_F] and not s.busy]
        rank = min((self.ranks[r].queues[_F][0], r) for r in idle)[1]
        if self.oldest_too:
            keys = self.oldest_keys
            self.oldest_too = rank == min((keys[self._oldest_first(r)], r) for r in idle)[1]
        self._start(rank, heapq.heappop(self.ranks[rank].queues[_F])[1], now)

    def _step(self, rank: int, now: int) -> None:
        """Start the idle ``rank``'s next action, if any, testing the caps only where the
        choice turns on them (so a run's trace holds no test whose answer could not matter)."""
        state, policy, pop = self.ranks[rank], self.policy, heapq.heappop
        fwd, inp, wgt = state.queues
        if inp and not (policy.alternate and state.last_was_i):
            index = pop(inp)[1]
        elif inp:  # alternating after an I: a forward the caps admit goes first
            if not self._forward_ok(state, rank):
                index = pop(inp)[1]
            else:
                index = pop(wgt if wgt and policy.eager_w else fwd)[1]
        elif wgt and policy.eager_w:
            index = pop(wgt)[1]
        elif self._forward_ok(state, rank):
            index = pop(fwd)[1]
        elif wgt:
            index = pop(wgt)[1]
        else:
            return
        self._start(rank, index, now)

    def _forward_ok(self, state: _Rank, rank: int) -> bool:
        """Whether the rank's first ready forward fits under the memory cap and its caps."""
        fwd = state.queues[_F]
        if not fwd:
            return False
        index = fwd[0][1]
        fits = state.held + self._need(state, index) <= self.cap
        if self.reserve_too:
            chain = self.chain[index] if self.enters[index] else 0.0
            self.reserve_too = fits == (state.held + state.reserved + chain <= self.cap)
        if self.oldest_too:  # "oldest"'s first forward must fit alike and enter alike
            other = self._oldest_first(rank)
            self.oldest_too = other == index or (
                fits == (state.held + self._need(state, other) <= self.cap)
                and (not fits or self.enters[other] == self.enters[index])
            )
        return fits and self._admits(state, rank, index)

    def _need(self, state: _Rank, index: int) -> float:
        """Bytes the forward ``index`` needs free (``reserve``: with what is reserved)."""
        if self.policy.reserve:
            return state.reserved + (self.chain[index] if self.enters[index] else 0.0)
        return self.size[index]

    def _oldest_first(self, rank: int) -> int:
        oldest = self.oldest[rank]
        while self.started[oldest[0][1]]:
            heapq.heappop(oldest)
        return oldest[0][1]

    def _admits(self, state: _Rank, rank: int, index: int) -> bool:
        """The cap test for a forward the memory admits; noted in ``state``'s trace."""
        caps, enters = self.policy.caps, self.enters[index]
        if caps is None or (self.policy.per_mb and not enters):
            admits = True
        else:
            admits = (state.mbs_ahead if self.policy.per_mb else state.ahead) < caps[rank]
        if admits:
            if state.ahead > state.passed:
                state.passed = state.ahead
            if enters and state.mbs_ahead > state.passed_mbs:
                state.passed_mbs = state.mbs_ahead
        else:
            if state.ahead < state.stopped:
                state.stopped = state.ahead
            if not enters:
                state.stopped_inside = True
            elif state.mbs_ahead < state.stopped_mbs:
                state.stopped_mbs = state.mbs_ahead
        return admits

    def _start(self, rank: int, index: int, now: int) -> None:
        state = self.ranks[rank]
        state.busy = True
        kind = self.kinds[index]
        if kind != _W or self.policy.w_resets:  # W may sit inside F, I, F, I
            state.last_was_i = kind == _I
        if kind == _F:
            size = self.size[index]
            if self.enters[index]:
                state.reserved += self.chain[index]
                state.mbs_ahead += 1
            state.reserved -= size
            state.held += size
            if state.held > state.peak:
                state.peak = state.held
            state.ahead += 1
            if self.watch:  # "oldest" must start the same forward
                self.oldest_too = self.oldest_too and self._oldest_first(rank) == index
                self.started[index] = True
        self.order[rank].append(self.actions[index])
        heapq.heappush(self.events, (now + self.duration[index], index, rank))
        if self.judge is not None:
            self._judge(rank, index)

    def _judge(self, rank: int, index: int) -> None:
        """The replay's end of the action the rank starts; raises :class:`_PastLimitError` when
        the rank's end plus its work left passes the limit."""
        judge, ends = self.judge, self.replay_end
        begin = self.replay_free[rank]
        for producer, hop in judge.producers[index]:
            ready = ends[producer] + hop
            if ready > begin:
                begin = ready
        ends[index] = self.replay_free[rank] = end = begin + judge.duration[index]
        self.replay_left[rank] -= judge.duration[index]
        if end + self.replay_left[rank] > self.limit:
            raise _PastLimitError


class _PastLimitError(Exception):
    """A judged run's replay must end past its limit."""
