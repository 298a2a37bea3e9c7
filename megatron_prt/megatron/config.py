"""What ``--pipeline-reuse*`` resolves to: one frozen value every module of the integration reads.

Kept free of megatron imports so flags can be validated (and tested) before megatron loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from ..core.layers import stage_layer_counts
from ..core.placement import ConfigError, Placement
from ..core.plan import Plan
from ..sim.cost import CostModel


@dataclass(frozen=True)
class ReuseConfig:
    """``placement``: P, R, loop|wave, uni|bi. ``stage_layers``: transformer layers of each
    model stage ``0..D-1`` in flow order (``None``: as even as possible, earlier stages take the
    remainder). ``trace_path``: where a traced iteration's Chrome trace goes (``None``: off).
    ``timeout_s``: how long a rank waits on a peer before :class:`PipelineError`.
    ``split_backward``: run every backward as I (input gradient) then W (weight gradient).
    ``plan``: the plan to run as it is (``--pipeline-reuse-plan``; ``None``: built from
    ``placement`` and ``schedule`` for the micro-batches of each call). ``auto_iterations``:
    with ``--pipeline-reuse auto``, the training calls profiled before the plan is tuned
    and switched (:mod:`megatron_prt.megatron.auto`; 0: off). ``auto_candidates``: how many
    of the tuned plans (best predicted first) auto then times on training iterations before
    it keeps the fastest measured one (1: the predicted best, untimed);
    ``auto_pick_reps``: timed iterations of each of them. ``recorded_vocab``: per cost or
    plan file that records its model's vocabulary, ``(which file, size)``, checked by
    :func:`~megatron_prt.megatron.plan_flag.warn_other_vocabulary` once the tokenizer is
    built (the flags' checks run before it is); ``recorded_kind`` likewise its model kind,
    checked once the first chunk is built (the flags do not say which model a script
    trains)."""

    placement: Placement
    num_layers: int
    stage_layers: tuple[int, ...] | None = None
    trace_path: str | None = None
    schedule: str = "prt"
    timeout_s: float = 60.0
    split_backward: bool = False
    plan: Plan | None = None
    tuned_bubble: float | None = None  # the plan file's: tune's bubble under its costs
    auto_iterations: int = 0
    auto_candidates: int = 3
    auto_pick_reps: int = 3
    recorded_vocab: tuple[tuple[str, int], ...] = ()
    recorded_kind: tuple[tuple[str, str], ...] = ()  # (which file, "gpt" | "bert")

    # [Note: a config pickles its plan as JSON] Megatron-LM saves ``args``, which carry this
    # config (``pipeline_reuse_config``), in every checkpoint and loads them with torch's
    # weights_only loader, which builds only the classes it was told of
    # (megatron_lm.validate_args: this one, Placement, AutoReuse). A plan's own classes
    # (actions, their columns) stopped every resume of a --pipeline-reuse-plan run; as its
    # JSON text it loads, and round-trips equal (Plan.from_dict).
    def __getstate__(self) -> dict:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.plan is not None:
            state["plan"] = self.plan.to_json(None)
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state.get("plan"), str):
            state = {**state, "plan": Plan.from_dict(json.loads(state["plan"]))}
        for name, value in state.items():
            object.__setattr__(self, name, value)  # frozen: as dataclasses' own __init__

    def __post_init__(self) -> None:
        self.layers_per_stage()  # refuse impossible counts at construction
        if self.plan is not None and self.plan.placement != self.placement:
            raise ConfigError("--pipeline-reuse-plan: the plan's placement is not the flags'")
        if self.plan is not None and self.split_backward and not self.plan.split_backward:
            raise ConfigError(  # the plan runs as it is: whole backwards, the flag unheeded
                "--pipeline-reuse-split-backward with a plan that runs whole backwards; drop "
                "the flag (the plan decides) or give a split-backward plan"
            )
        if not self.timeout_s > 0:
            raise ConfigError(f"--pipeline-reuse-timeout must be > 0 seconds, got {self.timeout_s}")
        if self.auto_candidates < 1 or self.auto_pick_reps < 1:
            raise ConfigError(
                f"--pipeline-reuse-auto-candidates must be >= 1 (1: switch to the predicted "
                f"best plan untimed), got {self.auto_candidates}; auto_pick_reps must be >= 1 "
                f"timed iteration per plan, got {self.auto_pick_reps}"
            )

    def layers_per_stage(self) -> tuple[int, ...]:
        """Layer count of every model stage ``0..D-1``; raises :class:`ConfigError`."""
        depth = self.placement.depth
        return stage_layer_counts(
            self.num_layers,
            depth,
            self.stage_layers,
            name="--pipeline-reuse-stage-layers",
            total=f"--num-layers {self.num_layers}",
            fix=f"use at least {depth} layers or lower --pipeline-reuse",
        )

    @property
    def splits_backward(self) -> bool:
        """Whether the plan runs split backward (I, then W): the flag or the plan file's."""
        return self.split_backward or (self.plan is not None and self.plan.split_backward)

    @property
    def name(self) -> str:
        """The schedule in a few words, e.g. ``PRT R=2 wave/uni`` (R = 1 uni is 1F1B's order)."""
        c = self.placement
        if c.reuse == 1 and c.direction == "uni":
            return "PRT R=1 (1F1B)"
        return f"PRT R={c.reuse} {c.placement}/{c.direction}"

    def describe(self) -> str:
        """One log line: :attr:`name`, what shapes the plan (a plan file, the interleaved
        order, split backward, auto) and the layers of every model stage in flow order."""
        parts = [self.name]
        if self.plan is not None:
            plan = self.plan
            parts.append(
                f"plan file ({plan.schedule} order, {plan.num_microbatches} micro-batches)"
            )
        elif self.schedule != "prt":
            parts.append(f"{self.schedule} order")
        if self.splits_backward:
            parts.append("split backward (I, then W)")
        if self.auto_iterations:
            parts.append(f"auto: tuned after {self.auto_iterations} profiled iterations")
        c = self.placement
        layers = ",".join(map(str, self.layers_per_stage()))
        return f"{', '.join(parts)}; {c.depth} stages on {c.ranks} ranks, layers {layers}"

    def layer_offset(self, model_stage: int) -> int:
        """Global index of the first layer of ``model_stage`` (0-based)."""
        return sum(self.layers_per_stage()[:model_stage])


def with_model_recompute(cost: CostModel, model_config) -> CostModel:
    """``cost`` under the model's activation recomputation, read from megatron's
    ``recompute_granularity``, ``recompute_method`` and ``recompute_num_layers`` on
    ``model_config`` (Megatron-LM's parsed args or a ``TransformerConfig``; absent: off), so
    a balanced partition weighs what recomputed layers keep and cost. The model's setting
    replaces the cost file's: the partition is for the model that runs."""
    names = ("recompute_granularity", "recompute_method", "recompute_num_layers")
    granularity, method, count = (getattr(model_config, name, None) for name in names)
    if granularity == "selective":  # megatron ignores the other two for selective
        method = count = None
    try:
        return cost.with_recompute(granularity, method, count)
    except ConfigError as exc:
        raise ConfigError(f"--pipeline-reuse-partition balanced: {exc}") from exc


def check_recompute_blocks(reuse: ReuseConfig, model_config) -> None:
    """megatron's full, uniform recomputation runs blocks of ``recompute_num_layers`` layers
    per model chunk, which under PRT is a model stage, and fails (an ``IndexError`` in the
    first forward) on a stage whose layer count is not a multiple; refuse that split here,
    before any collective. ``model_config``: Megatron-LM's args or a ``TransformerConfig``."""
    if getattr(model_config, "recompute_granularity", None) != "full":
        return
    if getattr(model_config, "recompute_method", None) != "uniform":
        return
    block = getattr(model_config, "recompute_num_layers", None) or 1
    counts = reuse.layers_per_stage()
    partial = [k for k, count in enumerate(counts) if count % block]
    if partial:
        fix = (
            "tune the plan file again with these --recompute-* flags (tune keeps blocks whole)"
            if reuse.plan is not None  # its split is the file's: the layout flags are refused
            else "--pipeline-reuse-stage-layers, or --pipeline-reuse-partition balanced, which "
            "keeps blocks whole"
        )
        raise ConfigError(
            f"--recompute-method uniform --recompute-num-layers {block} recomputes whole blocks "
            f"of {block} layers per model stage, but stages {partial[:4]} hold "
            f"{[counts[k] for k in partial[:4]]} layers (split {','.join(map(str, counts))}); "
            f"give every stage a multiple of {block} ({fix}), or use --recompute-method block"
        )
