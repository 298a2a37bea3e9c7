"""partition_memory's steps 1-3: the model, profiling it, the configurations chosen from the
simulator's predictions (:class:`PartitionCase`), and measuring them on forked gloo ranks
(the megatron training step is :func:`megatron_prt.megatron.bench.step_memory`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ...core import Placement, build_plan
from ...megatron.config import ReuseConfig
from ...runtime.local import all_ok, run_local
from ...sim.cost import CostModel
from ...sim.simulate import simulate
from ...tune.partition import DEFAULT_SLACK, partition, uniform_layers

MIB = 2**20
THROUGHPUT_TARGET = (
    0.95  # wave + balanced: >= this fraction of the best uniform PRT (same direction)
)
BALANCE_TARGET = 1.15  # wave + balanced: per-rank peak max/min at most this
AGREEMENT_TARGET = 0.10  # measured activation peak within this fraction of the prediction
REUSES = (2, 3, 4)
LEAST_MEMORY_SLACK = 1e6  # "any speed": the partitioner's least-memory answer
DEFAULT_OUT = "out/bench/partition_memory.md"


# -- what runs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bert:
    """Model and micro-batch sizes: ``layers`` transformer layers, ``hidden`` width,
    ``heads`` attention heads, ``seq`` tokens per sequence, ``mbs`` sequences per
    micro-batch, ``vocab`` tokens in the vocabulary."""

    layers: int = 24
    hidden: int = 128
    heads: int = 4
    seq: int = 128
    mbs: int = 2
    vocab: int = 4096


@dataclass(frozen=True)
class Config:
    """One way to run the model: a placement and the transformer layers of each model stage."""

    label: str
    placement: Placement
    stage_layers: tuple[int, ...]

    def reuse(self) -> ReuseConfig:
        return ReuseConfig(self.placement, sum(self.stage_layers), self.stage_layers)


def placement_label(placement: Placement) -> str:
    return f"R={placement.reuse} {placement.placement}/{placement.direction}"


def uniform_config(placement: Placement, num_layers: int) -> Config:
    label = "1F1B" if placement.reuse == 1 else f"{placement_label(placement)} uniform"
    return Config(label, placement, uniform_layers(num_layers, placement.depth))


# -- step 1: profile -----------------------------------------------------------------------------
def profile(model: Bert, reps: int = 3, profile_layers: int | None = None) -> dict:
    """The cost JSON of ``model`` (seconds and bytes per micro-batch), profiled on one
    forked rank with one thread, as a pipeline rank runs."""
    return all_ok(run_local(1, _profile_worker, model, reps, profile_layers))[0]


def _profile_worker(rank: int, world: int, model: Bert, reps: int, profile_layers) -> dict:
    from ...megatron.profile import profile_model

    return profile_model(
        "bert",
        model.layers,
        model.hidden,
        model.heads,
        model.seq,
        model.mbs,
        model.vocab,
        reps=reps,
        profile_layers=profile_layers,
    )


# -- step 2: predict -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """The simulator on the runtime's plan: ``makespan`` in seconds (profiled costs, free
    communication); per rank ``act`` (peak activation bytes) and ``state`` (parameter bytes
    of its stages and replicas: weights, gradients, Adam moments)."""

    makespan: float
    act: tuple[float, ...]
    state: tuple[float, ...]

    @property
    def totals(self) -> tuple[float, ...]:
        """Per rank: peak activation + state bytes."""
        return tuple(a + s for a, s in zip(self.act, self.state, strict=True))

    @property
    def max_total(self) -> float:
        return max(self.totals)

    @property
    def balance(self) -> float:
        """Largest over smallest per-rank total."""
        return max(self.totals) / min(self.totals)


def cost_model(costs: dict, stage_layers: Sequence[int] = ()) -> CostModel:
    return CostModel.from_dict({**costs, "stage_layers": list(stage_layers)})


def predict(costs: dict, config: Config, microbatches: int) -> Prediction:
    result = simulate(
        build_plan(config.placement, microbatches), cost_model(costs, config.stage_layers)
    )
    return Prediction(
        result.makespan,
        tuple(r.peak_activation_bytes for r in result.per_rank),
        tuple(r.param_bytes for r in result.per_rank),
    )


def uniform_prt_configs(ranks: int, num_layers: int) -> list[Config]:
    return [
        uniform_config(Placement(ranks, reuse, placement, direction), num_layers)
        for reuse in REUSES
        for placement in ("loop", "wave")
        for direction in ("uni", "bi")
    ]


def best_uniform(
    costs: dict, ranks: int, microbatches: int, direction: str | None = None
) -> tuple[Config, Prediction]:
    """The uniform PRT configuration with the smallest simulated makespan (of ``direction``
    only, when given)."""
    scored = [
        (c, predict(costs, c, microbatches))
        for c in uniform_prt_configs(ranks, len(costs["layers"]))
        if direction in (None, c.placement.direction)
    ]
    return min(scored, key=lambda cp: cp[1].makespan)


def best_by_direction(costs: dict, ranks: int, microbatches: int) -> dict:
    """``{"uni": best uniform uni, "bi": best uniform bi}``: the throughput yardsticks. A
    wave + balanced pick is held against the best uniform PRT of its own direction: bi keeps
    two weight replicas per rank (a different memory class), so the fastest bi plan is not
    what a uni partition trades against."""
    return {d: best_uniform(costs, ranks, microbatches, d) for d in ("uni", "bi")}


def balanced_config(
    costs: dict,
    placement: Placement,
    microbatches: int,
    *,
    slack: float = DEFAULT_SLACK,
    budget_bytes: float | None = None,
    tag: str = "balanced",
) -> Config:
    """The partitioner's answer for ``placement`` (raises ConfigError if ``budget_bytes``
    cannot be met)."""
    result = partition(
        cost_model(costs), placement, microbatches, slack=slack, budget_bytes=budget_bytes
    )
    return Config(f"{placement_label(placement)} {tag}", placement, result.stage_layers)


def target_slack(costs: dict, placement: Placement, microbatches: int, cap: float) -> float:
    """The slack that lets the partitioner trade time for memory up to makespan ``cap``
    (seconds): measured against the fastest partition it finds; < 0 if even that is slower."""
    fastest = partition(cost_model(costs), placement, microbatches).fastest_makespan
    return cap / fastest - 1.0


def wave_placements(ranks: int) -> list[Placement]:
    return [Placement(ranks, r, "wave", d) for r in REUSES for d in ("uni", "bi")]


def pick_wave(
    candidates: Sequence[tuple[Config, Prediction]], best_makespan: float
) -> tuple[Config, Prediction]:
    """The rule for "the R we pick": among the candidates whose simulated throughput is at
    least :data:`THROUGHPUT_TARGET` of ``best_makespan`` (the best uniform PRT of the
    candidates' direction), the smallest largest per-rank
    peak; if none is, the fastest (the throughput target is then missed whatever we pick)."""
    fast = [cp for cp in candidates if best_makespan / cp[1].makespan >= THROUGHPUT_TARGET]
    if fast:
        return min(fast, key=lambda cp: (cp[1].max_total, cp[1].makespan))
    return min(candidates, key=lambda cp: cp[1].makespan)


@dataclass(frozen=True)
class Pick:
    """Wave + balanced for one direction: the picked R, and the same placement with
    uniform layers (the like-for-like baseline)."""

    uniform: tuple[Config, Prediction]
    balanced: tuple[Config, Prediction]


@dataclass(frozen=True)
class PartitionCase:
    """Step 2's answer, the configurations of one partition-memory run (not a
    :class:`megatron_prt.core.plan.Plan`): every configuration measured, with its
    prediction."""

    f1b: tuple[Config, Prediction]
    best_uniform: tuple[Config, Prediction]  # any direction
    best: dict[str, tuple[Config, Prediction]]  # by direction: each pick's yardstick
    picks: dict[str, Pick]  # by direction, "uni" and "bi"
    wave_candidates: tuple[tuple[Config, Prediction], ...]

    def best_makespan(self, direction: str) -> float:
        return self.best[direction][1].makespan

    def measured(self) -> list[tuple[Config, Prediction]]:
        out = [self.f1b, self.best_uniform, *self.best.values()]
        for pick in self.picks.values():
            out += [pick.uniform, pick.balanced]
        return out


def make_case(costs: dict, ranks: int, microbatches: int) -> PartitionCase:
    num_layers = len(costs["layers"])
    f1b = uniform_config(Placement(ranks, 1, "loop", "uni"), num_layers)
    best = best_by_direction(costs, ranks, microbatches)
    candidates = []
    for placement in wave_placements(ranks):
        config = balanced_config(costs, placement, microbatches)
        candidates.append((config, predict(costs, config, microbatches)))
    picks = {}
    for direction in ("uni", "bi"):
        mine = [cp for cp in candidates if cp[0].placement.direction == direction]
        picked = pick_wave(mine, best[direction][1].makespan)
        same = uniform_config(picked[0].placement, num_layers)
        picks[direction] = Pick((same, predict(costs, same, microbatches)), picked)
    return PartitionCase(
        f1b=(f1b, predict(costs, f1b, microbatches)),
        best_uniform=min(best.values(), key=lambda cp: cp[1].makespan),
        best=best,
        picks=picks,
        wave_candidates=tuple(candidates),
    )


# -- step 3: measure on real ranks ----------------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    """One rank, one configuration, one training step: ``act_peak`` / ``act_held_after``
    activation bytes held for backward (peak; left at the end, 0 when every backward ran);
    ``params`` / ``grads`` / ``optimizer`` bytes of distinct storages after the optimizer
    step (weights; DDP gradient buffers; Adam moments and step counters)."""

    act_peak: int
    act_held_after: int
    params: int
    grads: int
    optimizer: int

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.act_peak + self.state


def measure(model: Bert, configs: Sequence[Config], microbatches: int) -> list[list[Measured]]:
    """``[config][rank]``: each configuration run for one step on P forked gloo ranks."""
    ranks = configs[0].placement.ranks
    per_rank = all_ok(
        run_local(ranks, _measure_worker, model, list(configs), microbatches, deadline_s=900)
    )
    return [[per_rank[r][i] for r in range(ranks)] for i in range(len(configs))]


def _measure_worker(rank, world, model: Bert, configs: list[Config], microbatches: int):
    from ...megatron import cpu
    from ...megatron.bench import BertShape, step_memory

    cpu.enable()
    shape = BertShape(**asdict(model))
    return [Measured(**step_memory(shape, c.reuse(), microbatches)) for c in configs]
