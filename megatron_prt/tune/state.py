"""The surrogate: one partition's exact stage costs and memory, its time as the larger of
per-rank lower bounds and the known critical paths, and the screening of single-layer moves
by what they change."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from itertools import accumulate

from .evaluate import Cut, Pool, Spec, better
from .memory import dot
from .problem import Problem

HOT_RANKS = 2  # donors come from at least this many worst ranks ...
SCREEN_PAIRS = 3_000  # ... or from as many as keep the screened moves per step near this


class State:
    """One partition under the surrogate: exact stage costs and memory; time as the larger
    of per-rank lower bounds and the known critical paths."""

    def __init__(self, problem: Problem, cuts: Sequence[Cut], counts: Sequence[int]) -> None:
        self.problem, self.cuts = problem, list(cuts)
        self.counts = tuple(counts)
        self.starts = [0, *accumulate(self.counts)]
        costs = self.costs = problem.stage_costs(self.counts)
        fwd_before = [0.0, *accumulate(costs.fwd)]
        bwd_before = [0.0, *accumulate(costs.bwd)]
        self.lbs, self.dots, self.acts, self.params = [], [], [], []
        for rank, slots in enumerate(problem.slots):
            work = problem.message_busy[rank] + sum(
                n * (costs.fwd[k] + costs.bwd[k])
                for k, n in zip(slots, problem.slot_mbs[rank], strict=True)
            )
            first = problem.first[rank]
            self.lbs.append(fwd_before[first] + bwd_before[first] + work)
            sizes = [costs.act[k] for k in slots]
            if costs.kept is not None:  # split backward: what W keeps, per slot, after them
                sizes += [costs.kept[k] for k in slots]
            self.dots.append([dot(v, sizes) for v in problem.vectors[rank]])
            self.acts.append(max(self.dots[-1], default=0.0))
            self.params.append(sum(costs.param[k] for k in slots))
        self.mems = [a + p for a, p in zip(self.acts, self.params, strict=True)]
        self.cut_values = [cut.value(costs) for cut in self.cuts]
        self.time = max(max(self.lbs), max(self.cut_values, default=0.0))
        self.lb_order = sorted(range(len(self.lbs)), key=lambda r: -self.lbs[r])
        self.mem_order = sorted(range(len(self.mems)), key=lambda r: -self.mems[r])
        # screening evaluates the same (rank, slot, layer) changes over and over
        self._act_cache: dict[tuple, float] = {}
        self._cut_cache: dict[tuple, list[float]] = {}

    def score(self, spec: Spec) -> tuple:
        return spec.score(self.time, self.lbs, self.mems)

    @staticmethod
    def score_for(spec: Spec):
        """Judge states by the surrogate."""
        return lambda state: state.score(spec)

    @staticmethod
    def simulated_score_for(spec: Spec, pool: Pool):
        """Judge states by simulation (pooled): the simulated makespan replaces the
        surrogate's."""

        def judge(state: State) -> tuple:
            point = pool.add(state.counts)
            return spec.score(point.makespan, state.lbs, point.rank_peaks)

        return judge

    def moved(self, donor: int, receiver: int, cuts: Sequence[Cut]) -> State:
        counts = list(self.counts)
        counts[donor] -= 1
        counts[receiver] += 1
        return State(self.problem, cuts, counts)

    # -- screening: score every move of one layer off a hot rank ----------------------------
    def screened_moves(self, spec: Spec, current: tuple | None) -> list[tuple[tuple, int, int]]:
        """Moves (score, donor stage, receiver stage) whose screened score beats
        ``current`` (all moves if None), best first. Screening counts only the moved
        layer's cost on the donor and the receiver (exact for identical layers; the stages
        in between shift by one layer each) and keeps each rank's fill and drain as they
        are (the critical paths see them); the caller simulates before accepting."""
        out = []
        base = self._base_sums(spec)
        donors = self._donors(spec)
        receivers = self._receivers(spec, donors)
        for donor in donors:
            for receiver in receivers:
                if receiver != donor:
                    score = self._move_score(spec, base, donor, receiver)
                    if current is None or better(score, current):
                        out.append((score, donor, receiver))
        out.sort(key=lambda m: (*m[0], m[1], m[2]))
        return out

    def _rank_order(self, spec: Spec) -> list[int]:
        """Ranks, worst first, by the binding part of the score."""
        by_memory = spec.hot_by_memory(self.score(spec)[0])
        return self.mem_order if by_memory else self.lb_order

    def _receivers(self, spec: Spec, donors: list[int]) -> list[int]:
        """Stages that may take a layer: on the donors' ranks and on the best ranks, as
        many as keep the screened moves near :data:`SCREEN_PAIRS`."""
        pr = self.problem
        per_rank = len(pr.slots[0])
        cold = max(HOT_RANKS, SCREEN_PAIRS // max(1, len(donors) * per_rank))
        if cold >= len(pr.slots):
            return list(range(pr.depth))
        ranks = {r for k in donors for r, _ in pr.holders[k]} | set(self._rank_order(spec)[-cold:])
        return sorted({k for r in ranks for k in pr.slots[r]})

    def _donors(self, spec: Spec) -> list[int]:
        """Stages that may give a layer: those on the worst ranks for the binding part of
        the score, plus the heaviest stages of the critical path when one binds."""
        pr = self.problem
        hot = max(HOT_RANKS, SCREEN_PAIRS // (pr.depth * len(pr.slots[0])))
        stages = [k for r in self._rank_order(spec)[:hot] for k in pr.slots[r]]
        path_binds = self.cut_values and max(self.cut_values) >= self.lbs[self.lb_order[0]]
        if path_binds and not spec.hot_by_memory(self.score(spec)[0]):
            cut = self.cuts[self.cut_values.index(max(self.cut_values))]
            weight = [
                cut.fwd_coef[k] * self.costs.fwd[k] + cut.bwd_coef[k] * self.costs.bwd[k]
                for k in range(pr.depth)
            ]
            heavy = sorted(range(pr.depth), key=lambda k: -weight[k])
            stages += heavy[: 2 * len(pr.slots[0])]
        return sorted({k for k in stages if self.counts[k] > pr.lows[k]})

    def _moved_layers(self, donor: int, receiver: int) -> tuple[int, int]:
        """(layer the donor gives up, layer the receiver gains): the run between them shifts."""
        if receiver < donor:
            return self.starts[donor], self.starts[receiver + 1]
        return self.starts[donor + 1] - 1, self.starts[receiver] - 1

    def _base_sums(self, spec: Spec) -> tuple[float, float]:
        """(memory excess over the limit, sum of squares of the tie-break) of this state."""
        if spec.kind == "time":
            excess = sum(max(0.0, m - spec.limit) for m in self.mems)
            return excess, sum(x * x for x in self.lbs)
        return 0.0, sum(x * x for x in self.mems)

    def _move_score(self, spec: Spec, base: tuple, donor: int, receiver: int) -> tuple:
        pr = self.problem
        lost_index, gained_index = self._moved_layers(donor, receiver)
        lost, gained = pr.layer_costs[lost_index], pr.layer_costs[gained_index]
        lb_delta: dict[int, float] = {}
        param_delta: dict[int, float] = {}
        act_terms: dict[int, list[tuple[int, float]]] = {}
        for stage, sign, layer in ((donor, -1.0, lost), (receiver, 1.0, gained)):
            for rank, slot in pr.holders[stage]:
                mbs = pr.slot_mbs[rank][slot]
                lb_delta[rank] = lb_delta.get(rank, 0.0) + sign * mbs * (layer[0] + layer[1])
                param_delta[rank] = param_delta.get(rank, 0.0) + sign * layer[3]
                act_terms.setdefault(rank, []).append((slot, sign * layer[2]))
                if pr.plan.split_backward:  # what W keeps, counted after the slots' own
                    kept = pr.layer_kept[lost_index if sign < 0 else gained_index]
                    act_terms[rank].append((len(pr.slots[rank]) + slot, sign * kept))
        new_lbs = {r: self.lbs[r] + d for r, d in lb_delta.items()}
        new_mems = {
            r: self.params[r] + param_delta[r] + self._act_after(r, terms)
            for r, terms in act_terms.items()
        }
        cut_max = self._cut_max(donor, receiver, lost, gained)
        time = max(_max_with(self.lbs, self.lb_order, new_lbs), cut_max)
        return self._aggregate(spec, base, time, new_lbs, new_mems)

    def _act_after(self, rank: int, terms: list[tuple[int, float]]) -> float:
        key = (rank, *terms)
        if key not in self._act_cache:
            vectors = self.problem.vectors[rank]
            self._act_cache[key] = max(
                (
                    dot + sum(v[slot] * delta for slot, delta in terms)
                    for v, dot in zip(vectors, self.dots[rank], strict=True)
                ),
                default=0.0,
            )
        return self._act_cache[key]

    def _cut_max(self, donor: int, receiver: int, lost: tuple, gained: tuple) -> float:
        """The known critical paths' largest value after the move: the two stages' times,
        and where each cut sends its own message, the hops of the cuts the move shifts."""
        if not self.cuts:
            return 0.0
        with_loss = self._cut_terms(donor, lost, -1.0, self.cut_values)
        values = map(operator.add, with_loss, self._cut_terms(receiver, gained, 1.0, None))
        shifted = self._shifted_hops(donor, receiver)
        if not shifted:
            return max(values)
        return max(
            value + sum(cut.hop_coef[c] * delta for c, delta in shifted)
            for value, cut in zip(values, self.cuts, strict=True)
        )

    def _shifted_hops(self, donor: int, receiver: int) -> list[tuple[int, float]]:
        """``(cut, change of its hop)`` for the cuts between donor and receiver, each of
        which moves one layer towards the donor (none where every cut's hop is alike)."""
        hop_at = self.problem.boundary_hop
        if hop_at is None:
            return []
        step = 1 if receiver < donor else -1
        cuts = range(min(donor, receiver), max(donor, receiver))
        changes = [
            (c, hop_at[self.starts[c + 1] + step] - hop_at[self.starts[c + 1]]) for c in cuts
        ]
        return [(c, delta) for c, delta in changes if delta]

    def _cut_terms(self, stage: int, layer: tuple, sign: float, base) -> list[float]:
        """Per cut: ``sign`` times the layer's time on ``stage`` (plus ``base``)."""
        key = (stage, layer, sign, base is None)
        if key not in self._cut_cache:
            terms = [
                sign * (cut.fwd_coef[stage] * layer[0] + cut.bwd_coef[stage] * layer[1])
                for cut in self.cuts
            ]
            self._cut_cache[key] = terms if base is None else list(map(operator.add, base, terms))
        return self._cut_cache[key]

    def _aggregate(self, spec: Spec, base: tuple, time: float, new_lbs, new_mems) -> tuple:
        """``spec.score`` of the moved state from the changed ranks only."""
        top_mem = _max_with(self.mems, self.mem_order, new_mems)
        excess, squares = base
        if spec.kind == "time":
            excess += sum(
                max(0.0, new - spec.limit) - max(0.0, self.mems[r] - spec.limit)
                for r, new in new_mems.items()
            )
            squares += sum(new * new - self.lbs[r] ** 2 for r, new in new_lbs.items())
            return (max(0.0, excess), time, squares, top_mem)
        squares += sum(new * new - self.mems[r] ** 2 for r, new in new_mems.items())
        return (max(0.0, time - spec.limit), top_mem, squares, time)


def _max_with(values: Sequence[float], order: Sequence[int], changed: dict[int, float]) -> float:
    """max over ranks of ``values`` with ``changed`` overriding; ``order`` sorts ranks by
    value, largest first."""
    best = max(changed.values(), default=-math.inf)
    for rank in order:
        if rank not in changed:
            return max(best, values[rank])
    return best
