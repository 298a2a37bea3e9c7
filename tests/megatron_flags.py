"""A stand-in of Megatron-LM's argument parser and the helpers the flag tests share: the
settings megatron_prt.megatron.args.validate_args reads, with Megatron's names, dests and
defaults (core_v0.16.1)."""

import argparse

import pytest

from megatron_prt.core.placement import ConfigError
from megatron_prt.megatron.args import add_arguments, validate_args


def megatron_like_parser() -> argparse.ArgumentParser:
    """The flags of Megatron-LM's parse_args (core_v0.16.1) that validate_args reads, with
    Megatron's names, dests and defaults."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add = parser.add_argument
    for name in (
        "--num-layers",
        "--encoder-num-layers",
        "--decoder-num-layers",
        "--micro-batch-size",
        "--global-batch-size",
        "--num-layers-per-virtual-pipeline-stage",
        "--num-virtual-stages-per-pipeline-rank",
        "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers",
        "--hidden-size",
        "--ffn-hidden-size",
        "--num-attention-heads",
        "--seq-length",
    ):
        add(name, type=int, default=None)
    add("--num-query-groups", type=int, default=1)
    for name in ("--bf16", "--fp16", "--swiglu", "--group-query-attention"):
        add(name, action="store_true")
    add("--transformer-impl", choices=("local", "transformer_engine"), default="transformer_engine")
    for name in (
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
    ):
        add(name, type=int, default=1)
    add("--rampup-batch-size", type=int, nargs=3, default=None)
    add("--pipeline-model-parallel-layout", default=None)
    for name in (
        "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split",
        "--overlap-grad-reduce",
        "--untie-embeddings-and-output-weights",
        "--recompute-activations",
    ):
        add(name, action="store_true")
    add("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    add("--recompute-granularity", choices=("full", "selective"), default=None)
    add("--recompute-method", choices=("uniform", "block"), default=None)
    add("--recompute-num-layers", type=int, default=None)
    add("--mtp-num-layers", type=int, default=None)
    add(  # a ModelParallelConfig field, as Megatron-LM's argument_utils names it
        "--microbatch-group-size-per-virtual-pipeline-stage",
        type=int,
        default=None,
        dest="microbatch_group_size_per_vp_stage",
    )
    add("--delay-wgrad-compute", action="store_true")
    add(
        "--cuda-graph-impl",
        choices=("none", "local", "transformer_engine", "full_iteration"),
        default="none",
    )
    return parser


def parse(*argv, world_size=8) -> argparse.Namespace:
    args = add_arguments(megatron_like_parser()).parse_args([str(a) for a in argv])
    args.world_size = world_size  # Megatron's parse_args reads it from WORLD_SIZE
    return args


# A valid PRT run: 8 ranks = DP 2 x PP 4, 8 layers, 4 micro-batches per iteration.
BASE = (
    "--num-layers",
    8,
    "--pipeline-model-parallel-size",
    4,
    "--micro-batch-size",
    1,
    "--global-batch-size",
    8,
)


def refusal(*argv, world_size=8) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_args(parse(*argv, world_size=world_size))
    return str(caught.value)
