"""The heuristic search: phases, starts and the local search over single-layer moves."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count

from ..core.layers import even_layers
from .evaluate import REL, Cut, Pool, Spec, better
from .problem import Problem
from .state import State

TRIES = 4  # best-screened moves judged per step, at least ...
STEP_WORK = 50_000  # ... or as many as this many simulated actions allow
ESCAPES = 8  # least-bad first moves tried for an improving pair at a local optimum
BLENDS = 8  # mixes of the fastest and the least-memory partition tried as starts
FAR_WORK = 1_000_000  # walks from far starts take this / (actions in the plan) steps ...
FAR_STEPS = 32  # ... or at least this many; with fewer, the least-memory start is skipped
RECAPS = 4  # memory searches rerun when one of them finds a faster partition
BISECTIONS = 6  # time caps tried when the fastest partitions exceed the budget


def search(
    pool: Pool, problem: Problem, uniform: tuple[int, ...], budget: float | None, slack: float
) -> None:
    """Fill ``pool`` with simulated partitions, ending at local optima of the objective."""
    for start in _starts(problem, uniform):
        pool.add(start)
    improve(pool, problem, Spec("time"))
    # the other end of the trade-off: the constrained searches start from both ends
    least = improve(pool, problem, Spec("memory"))
    if budget is None:
        cap = pool.fastest().makespan * (1 + slack)
        _improve_from_both_ends(pool, problem, Spec("memory", cap), least)
        for _ in range(RECAPS):  # a faster partition found on the way tightens the cap
            if pool.fastest().makespan * (1 + slack) == cap:
                return
            cap = pool.fastest().makespan * (1 + slack)
            improve(pool, problem, Spec("memory", cap))
        return
    fits = Spec("time", budget * (1 + REL))
    if pool.best(fits).peak > fits.limit and pool.points[least].peak <= fits.limit:
        _trade_time_for_memory(pool, problem, fits.limit, least)
    if pool.best(fits).peak <= fits.limit:
        improve(pool, problem, fits)


def _trade_time_for_memory(
    pool: Pool, problem: Problem, budget: float, least: tuple[int, ...]
) -> None:
    """Reach the budget from the memory side: least memory under a time cap, bisecting
    on the cap between the fastest and the least-memory partition (``least``). Searching
    time under the memory limit straight away stalls more often: the feasible set is
    narrow, and memory is what the surrogate knows exactly."""
    low, high = pool.fastest().makespan, pool.points[least].makespan
    for _ in range(BISECTIONS):
        cap = (low + high) / 2
        spec = Spec("memory", cap)
        _improve_from_both_ends(pool, problem, spec, least)
        best = pool.best(spec)
        if best.peak <= budget and best.makespan <= cap:
            high = best.makespan
        else:
            low = cap


def _improve_from_both_ends(
    pool: Pool, problem: Problem, spec: Spec, least: tuple[int, ...]
) -> None:
    """Least memory under a time cap from three starts that reach different local optima:
    the best partition so far (usually fast), the least-memory one (usually too slow) and
    the best mix of the two. The last two walk a bounded number of steps, and on long plans
    the least-memory start is skipped: the way back under the cap is long there and every
    step simulates."""
    fast = improve(pool, problem, spec)
    steps = FAR_WORK // len(problem.replayer.actions)
    if steps >= FAR_STEPS:
        improve(pool, problem, spec, least, steps)
    mixes = [_mix(fast, least, i / BLENDS) for i in range(1, BLENDS)]
    for counts in mixes:
        pool.add(counts)
    best_mix = min(mixes, key=lambda c: spec.exact_key(pool.points[c]))
    improve(pool, problem, spec, best_mix, max(steps, FAR_STEPS))


def _mix(a: Sequence[int], b: Sequence[int], weight: float) -> tuple[int, ...]:
    """Counts ``weight`` of the way from ``a`` to ``b``, rounded by largest remainder: they
    sum to the same layers and, like ``a`` and ``b``, respect the minimums."""
    target = [(1 - weight) * x + weight * y for x, y in zip(a, b, strict=True)]
    counts = [math.floor(t) for t in target]
    by_remainder = sorted(range(len(counts)), key=lambda k: (counts[k] - target[k], k))
    for k in by_remainder[: sum(a) - sum(counts)]:
        counts[k] += 1
    return tuple(counts)


def _starts(problem: Problem, uniform: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Uniform, evenly spread (remainder spread out, not at the front) and time-balanced."""
    layers, depth = problem.num_layers, problem.depth
    spread = tuple((k + 1) * layers // depth - k * layers // depth for k in range(depth))
    starts = [uniform, spread, _time_balanced(problem)]
    return [s for i, s in enumerate(starts) if s not in starts[:i]]


def _time_balanced(problem: Problem) -> tuple[int, ...]:
    """Contiguous counts minimising the largest stage time (forward + backward, with the
    embedding and the head): bisection on the limit, greedy fill per limit."""
    high = sum(_run_time(problem, k, 0, 0) for k in (0, problem.depth - 1))
    high = 2 * (high + problem.prefix["fwd"][-1] + problem.prefix["bwd"][-1])  # fits all
    low, best = 0.0, _greedy_fill(problem, high)
    for _ in range(50):
        mid = (low + high) / 2
        counts = _greedy_fill(problem, mid)
        if counts is None:
            low = mid
        else:
            high, best = mid, counts
    return best or even_layers(problem.num_layers, problem.depth)


def _greedy_fill(problem: Problem, limit: float) -> tuple[int, ...] | None:
    """Each stage takes as many layers as fit under ``limit`` (leaving the later stages
    their minimums); None if some stage cannot stay under it."""
    lows, depth, layers = problem.lows, problem.depth, problem.num_layers
    counts, first = [], 0
    for k in range(depth):
        most = layers - first - sum(lows[k + 1 :])
        take = lows[k] if k < depth - 1 else most
        while take < most and _run_time(problem, k, first, take + 1) <= limit:
            take += 1
        if take < lows[k] or take > most or _run_time(problem, k, first, take) > limit:
            return None
        counts.append(take)
        first += take
    return tuple(counts)


def _run_time(problem: Problem, stage: int, first: int, count: int) -> float:
    """Forward + backward time of ``stage`` holding layers ``first .. first+count-1``."""
    fwd, bwd, ends = problem.prefix["fwd"], problem.prefix["bwd"], problem.ends
    total = fwd[first + count] - fwd[first] + bwd[first + count] - bwd[first]
    if stage == 0:
        total += ends["fwd"][0] + ends["bwd"][0]
    if stage == problem.depth - 1:
        total += ends["fwd"][1] + ends["bwd"][1]
    return total


def improve(
    pool: Pool,
    problem: Problem,
    spec: Spec,
    start: tuple[int, ...] | None = None,
    max_steps: int | None = None,
) -> tuple[int, ...]:
    """Local search from ``start`` (default: the best simulated partition) for at most
    ``max_steps`` moves; returns where it stops, simulated. Each step simulates the moves
    the surrogate likes best and takes the first whose simulated score is better. When
    time does not matter the surrogate alone judges (it is exact on memory)."""
    counts = start or pool.best(spec).counts
    if spec.needs_time:  # small plans simulate fast: judge more of the screened moves
        judge = State.simulated_score_for(spec, pool)
        tries = max(TRIES, STEP_WORK // len(problem.replayer.actions))
    else:
        judge, tries = State.score_for(spec), TRIES
    descent = Descent(spec, judge, lambda: pool.cuts, tries)
    counts = descent.run(State(problem, pool.cuts, counts), max_steps).counts
    pool.add(counts)
    return counts


@dataclass(frozen=True)
class Descent:
    """Local search judged by ``judge`` (state -> score, smaller is better), trying the
    ``tries`` best-screened moves per step; ``cuts()`` gives the critical paths the states
    it creates use (simulating adds some)."""

    spec: Spec
    judge: Callable[[State], tuple]
    cuts: Callable[[], Sequence[Cut]]
    tries: int

    def run(self, state: State, max_steps: int | None) -> State:
        """Single-layer moves, then pairs, while the score improves (strictly, so it ends)."""
        current = self.judge(state)
        for _ in range(max_steps) if max_steps is not None else count():
            step = self._improving_move(state, current) or self._improving_pair(state, current)
            if step is None:
                break
            state, current = State(state.problem, self.cuts(), step[0].counts), step[1]
        return state

    def _improving_move(self, state: State, current: tuple) -> tuple[State, tuple] | None:
        for _, donor, receiver in state.screened_moves(self.spec, current)[: self.tries]:
            moved = state.moved(donor, receiver, self.cuts())
            score = self.judge(moved)
            if better(score, current):
                return moved, score
        return None

    def _improving_pair(self, state: State, current: tuple) -> tuple[State, tuple] | None:
        """Two moves that improve together although no single one does (a minimax
        objective often needs two ranks to change at once)."""
        for _, donor, receiver in state.screened_moves(self.spec, None)[:ESCAPES]:
            step = self._improving_move(state.moved(donor, receiver, self.cuts()), current)
            if step is not None:
                return step
        return None
