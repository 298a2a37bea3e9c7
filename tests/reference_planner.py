"""The planner as it was before the int-compiled list scheduler: the reference the fast
planner is checked against (tests/test_planner_equivalence.py). Action-keyed heaps and an
event per arrival, exactly as megatron_prt.core.greedy did; not used by the library."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_prt.core.actions import Action, Op
from megatron_prt.core.deps import consumers_map, producers
from megatron_prt.core.placement import Placement
from megatron_prt.core.plan import Plan, split_microbatches
from megatron_prt.core.replay import replay
from megatron_prt.core.schedules import _portfolio, makespan_lower_bound
from megatron_prt.core.timing import StageTimes

SortKey = Callable[[Action], tuple]


def oldest_first(action: Action) -> tuple:
    return (action.mb, action.stage)


@dataclass(frozen=True)
class Policy:
    flush: bool = False
    alternate: bool = True
    caps: tuple[int, ...] | None = None  # None: unbounded
    fwd_key: SortKey = oldest_first
    bwd_key: SortKey = oldest_first


@dataclass(frozen=True)
class ListResult:
    orders: tuple[tuple[Action, ...], ...]  # rank -> compute actions in execution order
    makespan: float
    peak_held: tuple[int, ...]  # rank -> most activations held at once


@dataclass
class _Rank:
    arrivals: list  # heap of (ready_time, key, action)
    fwd: list  # heap of (key, action)
    bwd: list  # heap of (key, action)
    forwards_left: int
    held: int = 0  # activations resident for a later backward
    peak: int = 0
    last_was_bwd: bool = False
    busy: bool = False


def required_actions(placement: Placement, mb_pipeline: Sequence[int]) -> list[Action]:
    """Every (stage, mb) F and B of a plan, in flow order per micro-batch."""
    out = []
    for mb, pipe in enumerate(mb_pipeline):
        for stage in placement.pipelines[pipe]:
            out.append(Action(stage, Op.F, mb))
        for stage in reversed(placement.pipelines[pipe]):
            out.append(Action(stage, Op.B, mb))
    return out


def list_schedule(
    placement: Placement,
    mb_pipeline: Sequence[int],
    times: StageTimes,
    policy: Policy,
) -> ListResult:
    """Schedule every F and B of ``mb_pipeline``'s micro-batches under ``policy``."""
    return ListScheduler(placement, mb_pipeline, times, policy).run()


class ListScheduler:
    """One list-scheduling run: every rank's state and the event queue, in integer ticks.

    Events are ``(time, seq, rank, finished action or None for a wake-up)``; ``seq`` keeps
    ties in push order, so the result is deterministic."""

    def __init__(
        self, placement: Placement, mb_pipeline: Sequence[int], times: StageTimes, policy: Policy
    ) -> None:
        self.placement, self.policy = placement, policy
        self.times, self.tick = times.in_ticks()
        self.actions, self.consumers, producer_counts, forwards = _graph(
            placement, tuple(mb_pipeline)
        )
        self.waiting = dict(producer_counts)
        self.ready_at = dict.fromkeys(self.actions, 0)
        self.rank_of = placement.stage_to_rank
        self.ranks = [_Rank([], [], [], count) for count in forwards]
        self.order: list[list[Action]] = [[] for _ in self.ranks]
        self.events: list = []
        self.seq = 0

    def run(self) -> ListResult:
        for action in self.actions:
            if self.waiting[action] == 0:
                self._arrive(action)
        done = now = 0
        while done < len(self.actions):
            if not self.events:  # every rank blocked by its cap alone
                rank = self._forced_rank()
                self._start(rank, self._pick(rank, force=True), now)
                continue
            now = self.events[0][0]
            touched, finished = self._drain(now)
            done += finished
            for rank in sorted(touched):
                state = self.ranks[rank]
                if not state.busy:
                    self._admit(state, now)
                    action = self._pick(rank)
                    if action is not None:
                        self._start(rank, action, now)
        orders = tuple(tuple(acts) for acts in self.order)
        return ListResult(orders, now * self.tick, tuple(state.peak for state in self.ranks))

    def _drain(self, now: int) -> tuple[set[int], int]:
        """Every event at ``now`` (ranks touched, actions finished), before any choice, so a
        backward that becomes ready now is seen by a rank that also became idle now."""
        touched, finished = set(), 0
        while self.events and self.events[0][0] == now:
            _, _, rank, action = heapq.heappop(self.events)
            touched.add(rank)
            if action is not None:
                finished += 1
                _finish(self.ranks[rank], action)
                for nxt in self.consumers[action]:
                    hop = self.times.p2p if self.rank_of[nxt.stage] != rank else 0
                    self.ready_at[nxt] = max(self.ready_at[nxt], now + hop)
                    self.waiting[nxt] -= 1
                    if self.waiting[nxt] == 0:
                        self._arrive(nxt)
        return touched, finished

    def _arrive(self, action: Action) -> None:
        rank = self.rank_of[action.stage]
        at = self.ready_at[action]
        heapq.heappush(self.ranks[rank].arrivals, (at, oldest_first(action), action))
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, rank, None))

    def _admit(self, state: _Rank, now: int) -> None:
        while state.arrivals and state.arrivals[0][0] <= now:
            _, _, action = heapq.heappop(state.arrivals)
            if action.op is Op.F:
                heapq.heappush(state.fwd, (self.policy.fwd_key(action), action))
            else:
                heapq.heappush(state.bwd, (self.policy.bwd_key(action), action))

    def _pick(self, rank: int, force: bool = False) -> Action | None:
        state, policy = self.ranks[rank], self.policy
        if policy.flush:
            if state.forwards_left:
                return heapq.heappop(state.fwd)[1] if state.fwd else None
            return heapq.heappop(state.bwd)[1] if state.bwd else None
        # warm-up: rank r admits caps[r] forwards before its first backward (a forward
        # runs only while fewer than caps[r] activations await their backward); the caps
        # come from :mod:`megatron_prt.core.schedules` (round_trip_caps, megatron_caps)
        cap = policy.caps[rank] if policy.caps else None
        fwd_ok = bool(state.fwd) and (force or cap is None or state.held < cap)
        # 1F1B alternation: after a backward prefer a forward, after a forward a backward.
        if fwd_ok and (not state.bwd or (policy.alternate and state.last_was_bwd)):
            return heapq.heappop(state.fwd)[1]
        if state.bwd:
            return heapq.heappop(state.bwd)[1]
        return None

    def _start(self, rank: int, action: Action, now: int) -> None:
        state = self.ranks[rank]
        state.busy = True
        state.last_was_bwd = action.op is not Op.F
        if action.op is Op.F:
            state.held += 1
            state.peak = max(state.peak, state.held)
            state.forwards_left -= 1
        self.order[rank].append(action)
        self.seq += 1
        end = now + self.times.busy(action, self.placement)
        heapq.heappush(self.events, (end, self.seq, rank, action))

    def _forced_rank(self) -> int:
        """All ranks idle and blocked by caps: the rank of the lowest-keyed admitted forward."""
        best = None
        for rank, state in enumerate(self.ranks):
            if not state.busy and state.fwd and (best is None or state.fwd[0] < best[0]):
                best = (state.fwd[0], rank)
        if best is None:
            raise RuntimeError("list scheduler stalled with no admissible action (bug)")
        return best[1]


def _graph(placement: Placement, mb_pipeline: tuple[int, ...]):
    """What every policy of a portfolio shares: the actions, their consumers, how many
    producers each waits for, and each rank's forward count. Read-only for callers."""
    actions = required_actions(placement, mb_pipeline)
    consumers = consumers_map(actions, placement)
    producer_counts = {a: len(producers(a, placement)) for a in actions}
    rank_of = placement.stage_to_rank
    forwards = tuple(
        sum(1 for a in actions if a.op is Op.F and rank_of[a.stage] == r)
        for r in range(placement.ranks)
    )
    return actions, consumers, producer_counts, forwards


def _finish(state: _Rank, action: Action) -> None:
    state.busy = False
    if action.op is Op.B:
        state.held -= 1


def _keys(placement: Placement, num_microbatches: int, name: str):
    if name == "depth_first":  # push the deepest ready forward on (frees memory sooner)
        return (lambda a: (-a.stage, a.mb)), (lambda a: (a.mb, a.stage))
    if name == "deepest":  # deepest first both ways: keeps the far end of a wave busy
        return (lambda a: (-a.stage, a.mb)), (lambda a: (-a.stage, a.mb))
    # "grouped": megatron-core's order: groups of P micro-batches (per pipeline) sweep a
    # pass, then the next pass; a short last group joins the previous one.
    width = placement.ranks * placement.num_pipelines
    groups = max(1, num_microbatches // width)
    depth, ranks = placement.depth, placement.ranks

    def group(mb: int) -> int:
        return min(mb // width, groups - 1)

    def fwd(a: Action) -> tuple:
        return (group(a.mb), (a.stage % depth) // ranks, a.mb)

    def bwd(a: Action) -> tuple:
        return (group(a.mb), -((a.stage % depth) // ranks), a.mb)

    return fwd, bwd


def reference_portfolio(placement: Placement, num_microbatches: int, times: StageTimes) -> Plan:
    """The old ``_prt_portfolio``: the portfolio's first plan at the lower bound, else the
    fastest (ties: fewer activations held)."""
    mb_pipeline = split_microbatches(num_microbatches, placement.num_pipelines)
    bound = makespan_lower_bound(placement, mb_pipeline, times)
    best = None
    num_actions = 2 * placement.depth * num_microbatches
    for caps, key_name, alternate in _portfolio(placement, times, num_actions):
        fwd_key, bwd_key = _keys(placement, num_microbatches, key_name)
        policy = Policy(caps=caps, fwd_key=fwd_key, bwd_key=bwd_key, alternate=alternate)
        result = list_schedule(placement, mb_pipeline, times, policy)
        if best is None or (result.makespan, max(result.peak_held)) < (
            best.makespan,
            max(best.peak_held),
        ):
            best = result
        if best.makespan <= bound * (1 + 1e-12):
            break
    return Plan(placement, num_microbatches, best.orders, "prt", mb_pipeline)


def reference_prt(
    placement: Placement, num_microbatches: int, times: StageTimes | None = None
) -> Plan:
    """The old ``schedules.prt``: the portfolio for ``times``, against the plans made for
    free messages and for equal stages, replayed under ``times``."""
    uniform = StageTimes.uniform(placement.depth)
    times = times or uniform
    best = reference_portfolio(placement, num_microbatches, times)
    alternatives = []
    if times.p2p or times.p2p_cpu:
        alternatives.append(StageTimes(times.fwd, times.bwd))
    if times.fwd != uniform.fwd or times.bwd != uniform.bwd or times.p2p or times.p2p_cpu:
        alternatives.append(uniform)
    best_makespan = replay(best, times).makespan
    for other_times in alternatives:
        other = reference_portfolio(placement, num_microbatches, other_times)
        makespan = replay(other, times).makespan
        if makespan < best_makespan:
            best, best_makespan = other, makespan
    return best


def reference_stuck(plan: Plan) -> dict[int, int]:
    """The blocking send/recv replay megatron_prt.core.validate ran before it was compiled
    (with its later rule that a SEND waits for its producer), one action at a time:
    ``{rank: step}`` where each rank that cannot finish stands."""
    from megatron_prt.core.lower import comm_key, message_ends, message_key

    placement, split, streams = plan.placement, plan.split_backward, plan.ranks
    pos = [0] * len(streams)
    done: set[Action] = set()
    received: set[tuple] = set()

    def inputs_ready(action: Action, rank: int) -> bool:
        for dep in producers(action, placement, split):
            if placement.rank_of(dep.stage) == rank:
                if dep not in done:
                    return False
            elif message_key(dep, action) not in received:
                return False
        return True

    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(streams):
            while pos[rank] < len(acts):
                action = acts[pos[rank]]
                if action.op.is_compute:
                    if not inputs_ready(action, rank):
                        break
                    done.add(action)
                elif action.op in (Op.SEND_F, Op.SEND_B):
                    producer, consumer = message_ends(action, placement, split)
                    if producer not in done:  # a SEND waits for the tensor it sends
                        break
                    key = message_key(producer, consumer)
                    peer = placement.rank_of(consumer.stage)
                    head = streams[peer][pos[peer]] if pos[peer] < len(streams[peer]) else None
                    if head is None or head.op not in (Op.RECV_F, Op.RECV_B):
                        break
                    if comm_key(head, placement, split) != key:
                        break
                    received.add(key)
                    pos[peer] += 1
                else:
                    break
                pos[rank] += 1
                progress = True
    return {r: p for r, p in enumerate(pos) if p < len(streams[r])}


def reference_lower(plan: Plan, times: StageTimes | None = None) -> Plan:
    """The lowering pass as it was before events became integers: one sort of tuples."""
    from dataclasses import replace

    from megatron_prt.core.deps import comm_ops

    placement = plan.placement
    timeline = replay(plan, times)
    actions = list(timeline.start)
    consumers = consumers_map(actions, placement, plan.split_backward)
    rank_of = placement.stage_to_rank
    start_level = _reference_levels(plan, timeline)

    def message_level(action: Action) -> int:  # a zero-time producer's message: one above
        zero = timeline.start[action] == timeline.end[action]
        return start_level[action] + 1 if zero else 0

    events = []  # (time, level, kind: 0 = message, 1 = compute, rank, action, consumer)
    for action, begin in timeline.start.items():
        rank = rank_of[action.stage]
        events.append((begin, start_level[action], 1, rank, action, None))
        for consumer in consumers[action]:
            if rank_of[consumer.stage] != rank:
                end = timeline.end[action]
                events.append((end, message_level(action), 0, rank, action, consumer))
    step = {a: i for acts in plan.ranks for i, a in enumerate(acts)}
    events.sort(key=lambda e: (e[0], e[1], e[2], e[3], step[e[4]]))
    streams: list[list[Action]] = [[] for _ in range(placement.ranks)]
    for _, _, kind, rank, action, consumer in events:
        if kind == 1:
            streams[rank].append(action)
            continue
        send_op, recv_op = comm_ops(action)
        streams[rank].append(Action(action.stage, send_op, action.mb))
        streams[rank_of[consumer.stage]].append(Action(consumer.stage, recv_op, action.mb))
    return replace(plan, ranks=tuple(tuple(s) for s in streams), lowered=True)


def _reference_levels(plan: Plan, timeline) -> dict[Action, int]:
    """Per compute action the level of its start among events at its instant: at least the
    level of the previous action of its rank starting then, and above the message of a
    zero-time producer on another rank ending then (a fixed point, one pass per hop)."""
    placement, split = plan.placement, plan.split_backward
    start, end = timeline.start, timeline.end
    level = dict.fromkeys(start, 0)
    changed = True
    while changed:
        changed = False
        for acts in plan.ranks:
            for before, action in zip((None, *acts[:-1]), acts, strict=True):
                need = level[before] if before is not None and start[before] == start[action] else 0
                for dep in producers(action, placement, split):
                    remote = placement.rank_of(dep.stage) != placement.rank_of(action.stage)
                    if remote and end[dep] == start[action] == start[dep]:
                        need = max(need, level[dep] + 1)
                if need > level[action]:
                    level[action], changed = need, True
    return level
