"""The partition problem: what does not change with the partition (the plan, compiled for
replay, and the per-layer costs), the stage costs of one partition, and the admissible ones."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate, combinations

from ..core.plan import Plan
from ..core.replay import Replayer
from ..core.timing import StageTimes
from ..sim.cost import CostModel
from .memory import inflight_vectors, peak_activation


def min_stage_layers(cost: CostModel, depth: int) -> tuple[int, ...]:
    """Fewest layers each model stage may get (see "Zero-layer stages" above)."""
    if len(cost.layers) < depth:
        return (0,) * depth
    lows = [1] * depth
    if cost.embedding is not None:
        lows[0] = 0
    if cost.head is not None:
        lows[-1] = 0
    return tuple(lows)


@dataclass(frozen=True)
class StageCosts:
    """Per model stage: forward and backward time, activation and parameter bytes, and under
    split backward the bytes held from I until W."""

    fwd: list[float]
    bwd: list[float]
    act: list[float]
    param: list[float]
    kept: list[float] | None = None  # split backward: what W keeps after I (bytes)
    hop: tuple[float, ...] = ()  # per cut (D - 1): its hop time under this split


class Problem:
    """Everything that does not change with the partition: the plan (compiled for replay)
    and what its order says about memory, per-layer prefix sums, admissible counts."""

    def __init__(self, cost: CostModel, plan: Plan) -> None:
        placement = plan.placement
        self.cost, self.plan, self.placement = cost, plan, placement
        self.depth = placement.depth
        self.num_layers = len(cost.layers)
        self.lows = min_stage_layers(cost, self.depth)
        self.layer_costs = [(c.fwd, c.bwd, c.act, c.param) for c in cost.layers]
        self.layer_kept = [c.wgrad_act(cost.wgrad_keep_fraction) for c in cost.layers]
        self.prefix = {
            attr: (0.0, *accumulate(getattr(layer, attr) for layer in cost.layers))
            for attr in ("fwd", "bwd", "act", "param")
        }
        ends = (cost.embedding, cost.head, cost.stage)  # stage: on every one of them
        self.ends = {
            attr: tuple(getattr(e, attr) if e is not None else 0.0 for e in ends)
            for attr in ("fwd", "bwd", "act", "param")
        }
        mbs_of_pipeline = [plan.mb_pipeline.count(p) for p in range(placement.num_pipelines)]
        self.slots = [[placement.model_stage(s) for s in st] for st in placement.rank_stages]
        self.slot_mbs = [
            [mbs_of_pipeline[placement.pipeline_of(s)] for s in st] for st in placement.rank_stages
        ]
        self.holders: list[list[tuple[int, int]]] = [[] for _ in range(self.depth)]
        for rank, slots in enumerate(self.slots):
            for slot, k in enumerate(slots):
                self.holders[k].append((rank, slot))
        self.first = [
            min((k for k, n in zip(slots, mbs, strict=True) if n), default=self.depth)
            for slots, mbs in zip(self.slots, self.slot_mbs, strict=True)
        ]
        self.vectors = [inflight_vectors(plan, rank) for rank in range(placement.ranks)]
        self.message_busy = message_busy(plan, cost.p2p_cpu)
        # a cut's hop after each count of layers before it (None: every cut's alike)
        after = [
            cost.cut_hop_times((b, self.num_layers - b))[0] for b in range(self.num_layers + 1)
        ]
        self.boundary_hop = after if len(set(after)) > 1 else None
        self.replayer = Replayer(plan)

    def stage_costs(self, counts: Sequence[int]) -> StageCosts:
        starts = [0, *accumulate(counts)]
        out = {}
        for attr, prefix in self.prefix.items():
            values = [prefix[starts[k + 1]] - prefix[starts[k]] for k in range(self.depth)]
            values[0] += self.ends[attr][0]
            values[-1] += self.ends[attr][1]
            values = [v + self.ends[attr][2] for v in values]  # see CostModel.stage
            if attr == "act":
                values = [
                    v + self.cost.stage_input_act(k, counts, self.depth)
                    for k, v in enumerate(values)
                ]
            out[attr] = values
        if self.cost.recompute_granularity is not None:  # block method: depends on the split
            model = replace(self.cost, stage_layers=tuple(counts))
            times = model.stage_times(self.placement)
            out["act"] = list(model.stage_activation_bytes(self.placement))
            out["fwd"], out["bwd"] = list(times.fwd), list(times.bwd)  # fwd: kept_split
        kept = None
        if self.plan.split_backward:  # the simulator's share, of this split's layers
            model = replace(self.cost, stage_layers=tuple(counts))
            shares = model.stage_wgrad_keep(self.placement)
            kept = [share * act for share, act in zip(shares, out["act"], strict=True)]
        hop = self.cost.cut_hop_times(counts)  # the messages change with the split
        return StageCosts(out["fwd"], out["bwd"], out["act"], out["param"], kept, hop)

    def stage_times(self, counts: Sequence[int]) -> StageTimes:
        """The simulator's stage times for ``counts`` (same sums, same rounding)."""
        return replace(self.cost, stage_layers=tuple(counts)).stage_times(self.placement)

    def rank_memory(self, costs: StageCosts) -> list[float]:
        """Per rank: peak activation bytes + parameter bytes."""
        out = []
        for rank, slots in enumerate(self.slots):
            sizes = [costs.act[k] for k in slots]
            if costs.kept is not None:
                sizes += [costs.kept[k] for k in slots]
            peak_act = peak_activation(self.vectors[rank], sizes)
            out.append(peak_act + sum(costs.param[k] for k in slots))
        return out


def message_busy(plan: Plan, p2p_cpu: float) -> list[float]:
    """Per rank: compute time its messages cost it (``p2p_cpu`` each), fixed by the plan."""
    if not p2p_cpu:
        return [0.0] * plan.placement.ranks
    zeros = (0.0,) * plan.placement.depth
    times = StageTimes(zeros, zeros, 0.0, p2p_cpu)
    return [
        sum(times.busy(a, plan.placement) for a in plan.compute_actions(rank))
        for rank in range(plan.placement.ranks)
    ]


def count_partitions(num_layers: int, lows: Sequence[int]) -> int:
    free = num_layers - sum(lows)
    return math.comb(free + len(lows) - 1, len(lows) - 1) if free >= 0 else 0


def partitions(num_layers: int, lows: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every admissible partition (stars and bars over the layers above the minimums)."""
    free, depth = num_layers - sum(lows), len(lows)
    for bars in combinations(range(free + depth - 1), depth - 1):
        edges = (-1, *bars, free + depth - 1)
        yield tuple(lows[k] + edges[k + 1] - edges[k] - 1 for k in range(depth))
