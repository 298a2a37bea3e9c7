"""megatron-core settings the PRT schedule cannot honour, refused at its first call (and,
under Megatron-LM, at the flags, by ``megatron_prt.megatron.args.validate_args``).

Each of these is a contract between megatron-core's model code and megatron's own
schedules: the model defers or records work that only those schedules finish (or start).
Under the PRT schedule that work would be skipped without a word, and the run would train
on wrong gradients or drift; so the forward-backward function refuses them by name, on
every rank alike (the settings are the same everywhere), before any micro-batch runs.

One row per setting: the config field, when it is on, and why it is refused with its fix.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.placement import ConfigError, Placement


def _on(value) -> bool:
    return bool(value)


def _balancing_types(value) -> list:
    return value if isinstance(value, list) else [value]


# field -> (is it on?, needs bi to be refused, why and the fix)
UNSUPPORTED: dict[str, tuple[Callable[[object], bool], bool, str]] = {
    "defer_embedding_wgrad_compute": (
        _on,
        False,
        "the output layer leaves its weight-gradient GEMMs in megatron's embedding buffers, "
        "which only megatron's schedules drain: its weight would get no gradient; drop "
        "--defer-embedding-wgrad-compute",
    ),
    "delay_wgrad_compute": (
        _on,
        False,
        "delayed weight gradients run only in megatron's combined-1F1B MoE schedule "
        "(backward_dw), which the PRT schedule replaces: they would never run; drop "
        "--delay-wgrad-compute (--pipeline-reuse-split-backward splits the backward here)",
    ),
    "overlap_moe_expert_parallel_comm": (
        _on,
        False,
        "it is megatron's own combined-1F1B schedule for MoE, which the PRT schedule "
        "replaces; drop --overlap-moe-expert-parallel-comm",
    ),
    "num_microbatches_with_partial_activation_checkpoints": (
        lambda value: value is not None,
        False,
        "the PRT schedule runs every micro-batch under the model's own recomputation "
        "setting: the partial count would be ignored; drop "
        "--num-microbatches-with-partial-activation-checkpoints",
    ),
    "fine_grained_activation_offloading": (
        _on,
        False,
        "megatron's schedules reset the offloading handlers each iteration and the PRT "
        "schedule does not; drop --fine-grained-activation-offloading",
    ),
    "cuda_graph_impl": (
        lambda value: value in ("local", "full_iteration"),
        False,
        "megatron's schedules capture the local CUDA graphs after the first iterations, and "
        "full_iteration captures one whole forward-backward call and then only replays it "
        "(the PRT runtime's host-side messages and checks cannot be captured); use "
        "--cuda-graph-impl none or transformer_engine",
    ),
    "moe_router_enable_expert_bias": (
        _on,
        True,
        "each bi replica's router counts only its own pipeline's tokens, so the two copies "
        "of a stage update expert_bias differently and route differently from then on; use "
        "--pipeline-reuse-direction uni or drop --moe-router-enable-expert-bias",
    ),
    "moe_router_load_balancing_type": (
        lambda value: "global_aux_loss" in _balancing_types(value),
        True,
        "global_aux_loss averages the tokens per expert over the micro-batches a router "
        "saw, half of them on each bi replica: the loss differs from the unpipelined run's; "
        "use --pipeline-reuse-direction uni or another --moe-router-load-balancing-type",
    ),
}


def refuse_unsupported(config, placement: Placement) -> None:
    """Raise :class:`ConfigError` naming the first setting of ``config`` (megatron-core's
    TransformerConfig of the model, or Megatron-LM's args, whose names are the same) that
    :data:`UNSUPPORTED` lists as on, for ``placement``'s direction. Fields missing from
    ``config`` (an older megatron-core) are skipped."""
    for field, (is_on, bi_only, why) in UNSUPPORTED.items():
        if bi_only and placement.direction != "bi":
            continue
        if is_on(getattr(config, field, None)):
            where = " with --pipeline-reuse-direction bi" if bi_only else ""
            raise ConfigError(
                f"megatron-prt: {field}={getattr(config, field)!r} is not supported{where}: {why}"
            )
    _refuse_grouping(config)


def _refuse_grouping(config) -> None:
    """``microbatch_group_size_per_vp_stage`` other than megatron's default (the pipeline
    size, which megatron-core sets when it is None) orders megatron's interleaved schedule,
    which the PRT schedule replaces: it was taken and ignored."""
    group = getattr(config, "microbatch_group_size_per_vp_stage", None)
    pipeline = getattr(config, "pipeline_model_parallel_size", None)
    if group is not None and group != pipeline:
        raise ConfigError(
            f"megatron-prt: microbatch_group_size_per_vp_stage={group!r} is not supported: it "
            "groups micro-batches in megatron's interleaved schedule, which the PRT schedule "
            "replaces (its plan orders them); drop "
            "--microbatch-group-size-per-virtual-pipeline-stage (or give it the pipeline "
            f"size, {pipeline})"
        )
