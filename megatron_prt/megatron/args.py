"""``--pipeline-reuse*`` flags for Megatron-LM: parse, refuse impossible settings, translate.

Imports neither torch nor megatron, so flags are checked (and tested) before megatron loads.
Line numbers below are Megatron-LM at tag ``core_v0.16.1``.

Contract:

1. Pass :func:`add_arguments` as ``extra_args_provider``; ``parse_args`` calls it on its
   parser (``megatron/training/arguments.py`` l.95-96).
2. Call :func:`validate_args` once ``args`` are final (after ``parse_args`` and, with
   ``--use-checkpoint-args``, after ``load_args_from_checkpoint``) and **before** Megatron's
   ``validate_args(args, defaults)``: in ``initialize_megatron``, right before its call at
   ``megatron/training/initialize.py`` l.92. Called after it, it raises.

Why before: with no virtual-pipeline flag, Megatron's ``validate_args`` asserts ``num_layers``
divisible by P (arguments.py l.555-571), which refuses valid PRT configs such as 6 layers on
P=4. We set ``--num-virtual-stages-per-pipeline-rank`` to the chunks per rank first; Megatron
then takes its l.551-554 branch, which copies it into ``virtual_pipeline_model_parallel_size``
(1 becomes ``None``) without any layer-count check, and ``get_model`` (training.py
l.1181-1204), the per-chunk data iterators (training.py l.978) and
``initialize_model_parallel`` (initialize.py l.367) build that many chunks per rank. After
Megatron's ``validate_args`` the assert has already fired and the chunk count is fixed.
Nothing we need comes from it: the data-parallel size (arguments.py l.327-328) and the default
global batch (l.497-498) are recomputed here the way Megatron does.

Tied embeddings are supported; the model-building code handles them, nothing here refuses them.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import replace

from ..core.layers import check_layers_fill_stages, layer_counts_arg
from ..core.paths import check_trace_prefix
from ..core.placement import DIRECTIONS, PLACEMENTS, ConfigError, Placement
from ..tune.memory import parse_bytes
from .config import ReuseConfig, check_recompute_blocks
from .plan_flag import (
    GIVEN,
    NotedStore,
    add_plan_argument,
    apply_plan_file,
    recorded_kinds,
    recorded_vocabularies,
    warn_other_shape,
)
from .unsupported import refuse_unsupported

PARTITIONS = ("uniform", "balanced")
DEFAULT_TIMEOUT_S = ReuseConfig.timeout_s  # as the runtime's default (README)
DEFAULT_AUTO_CANDIDATES = ReuseConfig.auto_candidates

# Defaults of the flags that only mean something with --pipeline-reuse (dest -> default).
_DEPENDENT_DEFAULTS = {
    "pipeline_reuse_placement": "loop",
    "pipeline_reuse_direction": "uni",
    "pipeline_reuse_partition": "uniform",
    "pipeline_reuse_stage_layers": None,
    "pipeline_reuse_costs": None,
    "pipeline_reuse_memory_budget": None,
    "pipeline_reuse_trace": None,
    "pipeline_reuse_timeout": DEFAULT_TIMEOUT_S,
    "pipeline_reuse_split_backward": False,
    "pipeline_reuse_auto_candidates": DEFAULT_AUTO_CANDIDATES,
}

# Megatron settings that also decide which layers go where; PRT owns the layer layout.
# ``virtual_pipeline_model_parallel_size`` has no flag: only code can have set it.
_LAYOUT_SETTINGS = (
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "pipeline_model_parallel_layout",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "virtual_pipeline_model_parallel_size",
)

# Encoder-decoder stacks (T5-style): PRT splits one stack of --num-layers layers.
_ENCODER_DECODER_SETTINGS = ("encoder_num_layers", "decoder_num_layers")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the PRT flags to ``parser`` and return it (Megatron's ``extra_args_provider``).
    One flat list of ``add_argument`` calls, longer than 60 lines on purpose: a reader finds
    every flag, its default and its help in one place, as in Megatron-LM's own arguments.py."""
    group = parser.add_argument_group(title="pipeline reuse (megatron-prt)")
    group.add_argument(
        "--pipeline-reuse",
        type=_reuse_value,
        default=None,
        metavar="R",
        help="Reuse each pipeline rank R times: a micro-batch crosses R * "
        "pipeline-model-parallel-size stages. Replaces Megatron's pipeline schedule. "
        f"auto[:R] (R default 1): profile the first {AUTO_ITERATIONS} training iterations, "
        "tune the plan for the model's layout (placement and layer split stay), time the "
        "best predicted plans on the next training iterations (see "
        "--pipeline-reuse-auto-candidates) and switch to the fastest measured one; rank 0 "
        "logs the choice. Default None: off.",
    )
    group.add_argument(
        "--pipeline-reuse-placement",
        choices=PLACEMENTS,
        action=NotedStore,
        default=_DEPENDENT_DEFAULTS["pipeline_reuse_placement"],
        help="Stage order over ranks: loop (0..P-1 every pass) or wave (passes alternate "
        "direction).",
    )
    group.add_argument(
        "--pipeline-reuse-direction",
        choices=DIRECTIONS,
        action=NotedStore,
        default=_DEPENDENT_DEFAULTS["pipeline_reuse_direction"],
        help="uni: one pipeline. bi: two counter-flowing pipelines over the same ranks "
        "(2R chunks per rank, >= 2 micro-batches).",
    )
    group.add_argument(
        "--pipeline-reuse-partition",
        choices=PARTITIONS,
        action=NotedStore,
        default=_DEPENDENT_DEFAULTS["pipeline_reuse_partition"],
        help="Layers per stage: uniform (earlier stages take the remainder) or balanced "
        "(least peak memory per rank within a small slack of the fastest split, from "
        "--pipeline-reuse-costs).",
    )
    group.add_argument(
        "--pipeline-reuse-costs",
        default=None,
        metavar="FILE",
        help="Cost JSON of the model (megatron-prt profile) for the balanced partition.",
    )
    group.add_argument(
        "--pipeline-reuse-memory-budget",
        type=byte_count,
        default=None,
        metavar="BYTES",
        help="Balanced partition: per-rank limit on activations + weights (e.g. 60GiB); "
        "the fastest split within it.",
    )
    group.add_argument(
        "--pipeline-reuse-stage-layers",
        type=layer_counts_arg,
        default=None,
        metavar="N,N,...",
        help="Transformer layers of each of the R*P model stages in flow order; must sum to "
        "--num-layers. Overrides --pipeline-reuse-partition.",
    )
    add_plan_argument(group)
    group.add_argument(
        "--pipeline-reuse-trace",
        default=None,
        metavar="PATH",
        help="Write a Chrome trace of a traced iteration to PATH.json (and PATH.png).",
    )
    group.add_argument(
        "--pipeline-reuse-timeout",
        type=_seconds,
        action=NotedStore,
        default=_DEPENDENT_DEFAULTS["pipeline_reuse_timeout"],
        metavar="SECONDS",
        help="How long a rank waits on a peer before it stops with a PipelineError naming "
        f"the rank it waited on (default {DEFAULT_TIMEOUT_S:g}).",
    )
    group.add_argument(
        "--pipeline-reuse-split-backward",
        action="store_true",
        help="Split every backward into input gradient (I, sent upstream at once) and weight "
        "gradient (W, the weight GEMMs alone, later). Default off.",
    )
    group.add_argument(
        "--pipeline-reuse-auto-candidates",
        type=positive_int,
        action=NotedStore,
        default=DEFAULT_AUTO_CANDIDATES,
        metavar="K",
        help="With --pipeline-reuse auto: after tuning, run each of the K best predicted "
        f"plans for 1 warm-up and {ReuseConfig.auto_pick_reps} timed training iterations "
        "(interleaved; training goes on, every plan gives the same gradients) and keep the "
        "one with the smallest median iteration time of the slowest rank. 1: switch to the "
        f"predicted best untimed. Default {DEFAULT_AUTO_CANDIDATES}.",
    )
    return parser


def byte_count(text: str) -> float:
    """argparse type of every byte flag (``--pipeline-reuse-memory-budget``, ``megatron-prt
    tune --memory-budget``, ``partition --budget``):
    :func:`megatron_prt.tune.memory.parse_bytes`."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the flag in its error); the CLI's too."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


class AutoReuse(int):
    """``--pipeline-reuse auto[:R]``: R, marked to tune the plan on measured costs."""


AUTO_ITERATIONS = 3  # training calls of --pipeline-reuse auto: 1 warm-up, 2 traced


def _reuse_value(text: str) -> int:
    """argparse type of ``--pipeline-reuse``: ``"2"`` -> 2, ``"auto"`` -> AutoReuse(1),
    ``"auto:2"`` -> AutoReuse(2)."""
    head, _, tail = text.partition(":")
    try:
        if head == "auto" and (tail or not text.endswith(":")):
            return AutoReuse(int(tail) if tail else 1)
        if not tail:
            return int(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"--pipeline-reuse takes R (an integer) or auto[:R], got {text!r}"
    )


def validate_args(args: argparse.Namespace) -> ReuseConfig | None:
    """Check the PRT flags against Megatron's and translate them onto Megatron's settings.

    Returns ``None`` when ``--pipeline-reuse`` is absent (then nothing is changed). Otherwise
    returns the :class:`ReuseConfig`, stores it as ``args.pipeline_reuse_config`` and sets the
    Megatron attributes of :func:`_translate_to_megatron`. Raises :class:`ConfigError` naming
    the flag and the fix for any impossible combination; makes no collective call. Must run
    before Megatron's ``validate_args`` (see the module docstring); a repeated call returns
    the stored config.
    """
    if getattr(args, "pipeline_reuse_config", None) is not None:
        return args.pipeline_reuse_config
    auto = isinstance(getattr(args, "pipeline_reuse", None), AutoReuse)
    if auto and getattr(args, "pipeline_reuse_plan", None) is not None:
        raise ConfigError(
            "--pipeline-reuse auto and --pipeline-reuse-plan both set: the plan file fixes "
            "the plan; drop one"
        )
    if auto and getattr(args, "rampup_batch_size", None):
        raise ConfigError(
            "--pipeline-reuse auto and --rampup-batch-size both set: the tuned plan is for "
            "one number of micro-batches per iteration; drop --rampup-batch-size or give "
            "--pipeline-reuse R"
        )
    if getattr(args, "pipeline_reuse_plan", None) and getattr(args, "rampup_batch_size", None):
        raise ConfigError(  # the run stopped mid-way when the ramp grew the batch
            "--pipeline-reuse-plan and --rampup-batch-size both set: the plan file runs one "
            "number of micro-batches per iteration, which the ramp changes; drop "
            "--rampup-batch-size or the plan file"
        )
    plan_file = apply_plan_file(args, _DEPENDENT_DEFAULTS, _microbatches_per_iteration(args))
    if getattr(args, "pipeline_reuse", None) is None:
        _refuse_flags_without_reuse(args)
        return None
    _refuse_late_call(args)
    _check_reuse_and_pipeline(args)
    _check_balanced_partition(args)
    _refuse_megatron_layouts(args)
    _refuse_unsupported_flags(args)
    config = _reuse_config(args)
    _check_copied_chunks(args, config)
    refuse_unsupported(args, config.placement)  # as the schedule would, before any model
    if plan_file is not None:
        tuned = (plan_file.tuned or {}).get("bubble_fraction")
        tuned = float(tuned) if isinstance(tuned, (int, float)) else None
        config = replace(config, plan=plan_file.plan, tuned_bubble=tuned)
    config = replace(
        config,
        recorded_vocab=recorded_vocabularies(args, plan_file),
        recorded_kind=recorded_kinds(args, plan_file),
    )
    check_recompute_blocks(config, args)
    if auto:
        config = replace(config, auto_iterations=AUTO_ITERATIONS)
    _check_auto_candidates(args, auto)
    _check_microbatches(args, config.placement)
    if config.trace_path is not None:
        check_trace_prefix(config.trace_path, "--pipeline-reuse-trace")
    _translate_to_megatron(args, config)
    return config


def _translate_to_megatron(args: argparse.Namespace, config: ReuseConfig) -> None:
    """Set what Megatron reads so that it builds ``chunks_per_rank`` model chunks per rank."""
    chunks = config.placement.chunks_per_rank
    # Megatron's validate_args copies this into virtual_pipeline_model_parallel_size
    # (arguments.py l.551-554) and then skips its num_layers % P assert.
    args.num_virtual_stages_per_pipeline_rank = chunks
    # What Megatron will derive, set now for code that reads args before its validate_args.
    args.virtual_pipeline_model_parallel_size = chunks if chunks > 1 else None
    if chunks > 1:
        # With chunks and no p2p overlap Megatron demands P > 2 (arguments.py l.578-582), a
        # limit of its interleaved schedule; PRT does its own p2p and ignores the flag.
        args.overlap_p2p_comm = True
    args.pipeline_reuse_config = config


def _refuse_flags_without_reuse(args: argparse.Namespace) -> None:
    # Flags with a default note that they were given (NotedStore), so one given as its
    # default is refused too (it would be ignored: megatron's own schedule runs).
    noted = getattr(args, GIVEN, ())
    given = [
        _flag(dest)
        for dest, default in _DEPENDENT_DEFAULTS.items()
        if dest in noted or getattr(args, dest, default) != default
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)} given without --pipeline-reuse; add --pipeline-reuse R "
            "(R=1 for plain 1F1B), --pipeline-reuse auto[:R] for "
            "--pipeline-reuse-auto-candidates, or drop them"
        )


def _refuse_late_call(args: argparse.Namespace) -> None:
    # Megatron's validate_args sets this attribute first thing (arguments.py l.325).
    if hasattr(args, "transformer_pipeline_model_parallel_size"):
        raise ConfigError(
            "--pipeline-reuse was validated after Megatron's validate_args, which has already "
            "fixed the virtual-pipeline size; call megatron_prt.megatron.args.validate_args "
            "before it"
        )


def _check_reuse_and_pipeline(args: argparse.Namespace) -> None:
    if args.pipeline_reuse < 1:
        raise ConfigError(
            f"--pipeline-reuse must be >= 1, got {args.pipeline_reuse}; "
            "use 1 for plain 1F1B, 2 or more to reuse each rank"
        )
    ranks = getattr(args, "pipeline_model_parallel_size", 1)
    if ranks < 2:
        raise ConfigError(
            f"--pipeline-reuse needs a pipeline, but --pipeline-model-parallel-size is "
            f"{ranks}; use --pipeline-model-parallel-size 2 or more, or drop --pipeline-reuse"
        )


def _check_balanced_partition(args: argparse.Namespace) -> None:
    """``balanced`` needs costs to balance by; explicit stage layers override it."""
    balanced = args.pipeline_reuse_partition == "balanced"
    costs = getattr(args, "pipeline_reuse_costs", None)
    budget = getattr(args, "pipeline_reuse_memory_budget", None)
    if balanced and args.pipeline_reuse_stage_layers is not None:
        raise ConfigError(
            "--pipeline-reuse-partition balanced and --pipeline-reuse-stage-layers both set "
            "the layers per stage; give one of them"
        )
    if balanced and costs is None:
        raise ConfigError(
            "--pipeline-reuse-partition balanced needs --pipeline-reuse-costs FILE (a cost "
            "JSON: `megatron-prt profile --model bert ... -o FILE` measures one)"
        )
    if not balanced and (costs is not None or budget is not None):
        raise ConfigError(
            "--pipeline-reuse-costs and --pipeline-reuse-memory-budget are read only with "
            "--pipeline-reuse-partition balanced"
        )


def _balanced_stage_layers(args: argparse.Namespace, placement: Placement) -> tuple[int, ...]:
    """Layers per model stage from the cost-model partitioner (deterministic, so every rank
    computes the same split without communicating)."""
    from ..sim.cost import CostModel
    from ..tune.partition import partition
    from .config import with_model_recompute

    try:
        cost = CostModel.load(args.pipeline_reuse_costs)
    except ConfigError as exc:  # the message starts with the file name
        raise ConfigError(f"--pipeline-reuse-costs {exc}") from exc
    cost = with_model_recompute(cost, args)
    if len(cost.layers) != args.num_layers:
        raise ConfigError(
            f"--pipeline-reuse-costs {args.pipeline_reuse_costs} describes {len(cost.layers)} "
            f"layers, --num-layers is {args.num_layers}; profile the model you train"
        )
    warn_other_shape(
        args, cost.model, f"--pipeline-reuse-costs {args.pipeline_reuse_costs} was profiled on",
        "the layer split is balanced on another model's costs; give --pipeline-reuse-costs "
        "a profile of this model (`megatron-prt profile` with these flags)",
    )  # fmt: skip
    microbatches = _microbatches_per_iteration(args)
    if microbatches is None:
        raise ConfigError(
            "--pipeline-reuse-partition balanced needs the micro-batches per iteration: give "
            "--micro-batch-size and --global-batch-size"
        )
    budget = getattr(args, "pipeline_reuse_memory_budget", None)
    try:
        # a split-backward run is balanced on the split form's costs, as tune balances it
        schedule = "zb" if getattr(args, "pipeline_reuse_split_backward", False) else "prt"
        result = partition(cost, placement, microbatches, budget_bytes=budget, schedule=schedule)
    except ConfigError as exc:  # e.g. no split within --pipeline-reuse-memory-budget
        flag = "--pipeline-reuse-memory-budget" if budget else "--pipeline-reuse-partition"
        raise ConfigError(f"{flag}: {exc}") from exc
    return result.balanced.stage_layers


def _refuse_megatron_layouts(args: argparse.Namespace) -> None:
    # --use-mp-args-from-checkpoint-args copies the chunk count PRT set into a PRT
    # checkpoint's args: checked against this run's once the placement is known
    copied = getattr(args, "use_mp_args_from_checkpoint_args", False)
    names = [n for n in _LAYOUT_SETTINGS if not (copied and n == _COPIED_CHUNKS)]
    layouts = [_flag(name) for name in names if _is_set(args, name)]
    if layouts:
        raise ConfigError(
            f"{', '.join(layouts)} {_verb(layouts)} with --pipeline-reuse, which owns the layer "
            "layout; drop them and give uneven stages with --pipeline-reuse-stage-layers"
        )
    stacks = [_flag(name) for name in _ENCODER_DECODER_SETTINGS if _is_set(args, name)]
    if stacks:
        raise ConfigError(
            f"{', '.join(stacks)} {_verb(stacks)} with --pipeline-reuse, which splits a single "
            "stack; give its layers with --num-layers instead"
        )


def _refuse_unsupported_flags(args: argparse.Namespace) -> None:
    """Megatron-LM flags PRT does not run, refused before anything is built: multi-token
    prediction (its layers are not in PRT's layout: megatron built none and trained without
    the MTP loss) and context parallelism."""
    if getattr(args, "mtp_num_layers", None):  # 0 is megatron's off
        raise ConfigError(
            "--mtp-num-layers conflicts with --pipeline-reuse: multi-token prediction's "
            "layers are not in PRT's stage layout (megatron would build none and train "
            "without the MTP loss); drop --mtp-num-layers"
        )
    if (getattr(args, "context_parallel_size", None) or 1) > 1:
        raise ConfigError(
            f"--context-parallel-size {args.context_parallel_size} with --pipeline-reuse: "
            "context parallelism is not supported; use --context-parallel-size 1"
        )


_COPIED_CHUNKS = "virtual_pipeline_model_parallel_size"


def _check_copied_chunks(args: argparse.Namespace, config: ReuseConfig) -> None:
    """A chunk count megatron copied from the checkpoint's args must be this run's."""
    copied = getattr(args, _COPIED_CHUNKS, None)
    chunks = config.placement.chunks_per_rank
    if copied is not None and copied != chunks:
        raise ConfigError(
            f"--use-mp-args-from-checkpoint-args took virtual_pipeline_model_parallel_size "
            f"{copied} from the checkpoint; this run's {config.placement} has {chunks} "
            "chunks per rank: the checkpoint was saved under another layout; resume under "
            "its --pipeline-reuse flags, or drop --use-mp-args-from-checkpoint-args"
        )


def _verb(flags: list) -> str:
    return "conflicts" if len(flags) == 1 else "conflict"


def _reuse_config(args: argparse.Namespace) -> ReuseConfig:
    num_layers = getattr(args, "num_layers", None)
    if num_layers is None:
        raise ConfigError("--pipeline-reuse needs --num-layers (the layers split into stages)")
    placement = Placement(
        ranks=args.pipeline_model_parallel_size,
        reuse=args.pipeline_reuse,
        placement=args.pipeline_reuse_placement,
        direction=args.pipeline_reuse_direction,
    )
    stage_layers = args.pipeline_reuse_stage_layers
    if args.pipeline_reuse_partition == "balanced":
        # the uniform split's rule, so balanced never hands out stages with no layer either
        check_layers_fill_stages(num_layers, placement.depth, "--num-layers", "--pipeline-reuse")
        stage_layers = _balanced_stage_layers(args, placement)
    return ReuseConfig(
        placement=placement,
        num_layers=num_layers,
        stage_layers=stage_layers,
        trace_path=args.pipeline_reuse_trace,
        timeout_s=getattr(args, "pipeline_reuse_timeout", DEFAULT_TIMEOUT_S),
        split_backward=bool(getattr(args, "pipeline_reuse_split_backward", False)),
        auto_candidates=getattr(args, "pipeline_reuse_auto_candidates", DEFAULT_AUTO_CANDIDATES),
    )


def _check_auto_candidates(args: argparse.Namespace, auto: bool) -> None:
    candidates = getattr(args, "pipeline_reuse_auto_candidates", DEFAULT_AUTO_CANDIDATES)
    given = "pipeline_reuse_auto_candidates" in getattr(args, GIVEN, ())  # its default too
    if not auto and (given or candidates != DEFAULT_AUTO_CANDIDATES):
        plan_file = getattr(args, "pipeline_reuse_plan", None)
        if plan_file is not None:
            raise ConfigError(
                f"--pipeline-reuse-auto-candidates {candidates} given with --pipeline-reuse-plan "
                f"{plan_file}: it sets how many tuned plans --pipeline-reuse auto times, and the "
                "plan file fixes the plan; drop it"
            )
        raise ConfigError(
            f"--pipeline-reuse-auto-candidates {candidates} given with --pipeline-reuse "
            f"{args.pipeline_reuse}: it sets how many tuned plans --pipeline-reuse auto times; "
            f"use --pipeline-reuse auto:{args.pipeline_reuse} or drop it"
        )


def _check_microbatches(args: argparse.Namespace, placement: Placement) -> None:
    if placement.num_pipelines < 2:
        return  # uni runs any number of micro-batches
    count = _microbatches_per_iteration(args)
    # Unknown count (no micro batch or data-parallel size yet): skipped here; the plan
    # builder refuses bi with fewer than 2 micro-batches when the schedule is built.
    if count is not None and count < 2:
        raise ConfigError(
            f"--pipeline-reuse-direction bi needs >= 2 micro-batches per iteration (one per "
            f"pipeline), got {count} = global batch // (--micro-batch-size * data-parallel "
            "size); raise --global-batch-size (and any --rampup-batch-size start), lower "
            "--micro-batch-size, or use --pipeline-reuse-direction uni"
        )


def _microbatches_per_iteration(args: argparse.Namespace) -> int | None:
    """Megatron's count, global batch // (micro batch * data-parallel size), for the
    smallest global batch of the run; ``None`` when not yet known."""
    micro = getattr(args, "micro_batch_size", None)
    data_parallel = _data_parallel_size(args)
    if not micro or data_parallel is None:
        return None
    per_step = micro * data_parallel
    # Megatron's default global batch is one micro-batch per replica (arguments.py l.497-498).
    global_batch = getattr(args, "global_batch_size", None) or per_step
    rampup = getattr(args, "rampup_batch_size", None)
    if rampup:  # [start, increment, samples]: the ramp starts at the smallest batch
        global_batch = min(global_batch, int(rampup[0]))
    return global_batch // per_step


def _data_parallel_size(args: argparse.Namespace) -> int | None:
    known = getattr(args, "data_parallel_size", None)
    if known is not None:
        return known
    # Before Megatron's validate_args: derive it as Megatron will (arguments.py l.327-328);
    # a parser of the user's own has no world_size: the launcher's, as Megatron's parse_args
    world = getattr(args, "world_size", None)
    if world is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world = int(os.environ["WORLD_SIZE"])
    model_size = 1
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
    ):
        model_size *= getattr(args, name, None) or 1
    if world is None or world % model_size:
        return None  # Megatron's own world-size check refuses the indivisible case
    return world // model_size


def _is_set(args: argparse.Namespace, name: str) -> bool:
    value = getattr(args, name, None)
    return value is not None and value is not False


def _flag(dest: str) -> str:
    if dest == "virtual_pipeline_model_parallel_size":  # no command-line flag exists
        return "virtual_pipeline_model_parallel_size (set in code)"
    return "--" + dest.replace("_", "-")
