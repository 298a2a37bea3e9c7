"""Layer specs other than megatron's local one, on CPU: Transformer Engine cannot run here, so
the parts of megatron-prt that only read a model's structure (chunk building,
prepare_model, the schedule, split backward, the profiler's part hooks) are run on a GPT
whose layers are built like the TE spec's: the input and pre-MLP layer norms fused into
the first linear layer (the norm slots are megatron's IdentityOp), and linear layers of a
class and autograd path of their own, neither megatron's ColumnParallelLinear /
RowParallelLinear nor ``nn.Linear`` (as TE's are not).
PRT equals megatron's no-pipelining schedule on that model in float64 (1e-12 losses, 1e-10
gradients), so nothing on these paths depends on the local spec's module types. The TE
spec itself is checked on GPUs by scripts/gpu_te_parity.sh.
"""

from __future__ import annotations

from functools import partial

import pytest

pytest.importorskip("megatron.core")

import torch
from megatron_models import (
    MBS,
    SEQ,
    VOCAB,
    grads_by_name,
    reference,
    setup_megatron,
    step_kwargs,
    transformer_config,
)

from megatron_prt.core import Placement
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.runtime.local import all_ok, run_local

LAYERS, M = 4, 4


class ForeignLinear(torch.nn.Module):
    """A linear layer of its own class and autograd path (``F.linear``), as TE's are to
    megatron: neither a megatron parallel linear nor an ``nn.Linear``, so split backward
    leaves it on the generic path. Takes megatron's build_module arguments and returns
    megatron's ``(output, bias)``; ``norm``: a layer norm fused in front (TE's
    TELayerNormColumnParallelLinear). Tensor-parallel size 1 here."""

    def __init__(self, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 norm=False, **unused):  # fmt: skip
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        super().__init__()
        self.norm = WrappedTorchNorm(config, input_size, config.layernorm_epsilon) if norm else None
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype)
        )
        init_method(self.weight)
        zeros = torch.zeros(output_size, dtype=config.params_dtype)
        self.bias = torch.nn.Parameter(zeros) if bias else None
        self.skip_bias_add = skip_bias_add

    def forward(self, x):
        if self.norm is not None:
            x = self.norm(x)
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias), None


class NormColumnLinear(ForeignLinear):
    def __init__(self, input_size, output_size, **kwargs):
        super().__init__(input_size, output_size, norm=True, **kwargs)


def fused_norm_spec():
    """megatron's local GPT layer spec with the TE spec's shape (see the module docstring)."""
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    spec = get_gpt_layer_local_spec()
    layer = spec.submodules
    attention, mlp = layer.self_attention, layer.mlp
    attention = replace(
        attention,
        submodules=replace(
            attention.submodules, linear_qkv=NormColumnLinear, linear_proj=ForeignLinear
        ),
    )
    mlp_linears = {"linear_fc1": NormColumnLinear, "linear_fc2": ForeignLinear}
    if isinstance(mlp, partial):  # megatron-core 0.19: partial(MLP.as_mlp_submodule, submodules=)
        submodules = replace(mlp.keywords["submodules"], **mlp_linears)
        mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    else:
        mlp = replace(mlp, submodules=replace(mlp.submodules, **mlp_linears))
    layer = replace(
        layer,
        input_layernorm=IdentityOp,
        pre_mlp_layernorm=IdentityOp,
        self_attention=attention,
        mlp=mlp,
    )
    return replace(spec, submodules=layer)


def _build(config, pre_process=True, post_process=True, vp_stage=None):
    from megatron_prt.megatron.pretrain import build_model

    default = torch.get_default_dtype()
    torch.set_default_dtype(config.params_dtype)  # the torch-norm fallback ignores params_dtype
    try:
        return build_model(
            "gpt", config, VOCAB, SEQ, pre_process, post_process, vp_stage,
            layer_spec=fused_norm_spec(),
        )  # fmt: skip
    finally:
        torch.set_default_dtype(default)


def _reference(rank, world):
    return reference(rank, world, "gpt", LAYERS, M, build=lambda kind, config: _build(config))


def _prt(rank, world, reuse, state):
    from megatron_prt.megatron import build_chunks, make_forward_backward_func, prepare_model
    from megatron_prt.megatron.model import transformer_config_kwargs
    from megatron_prt.megatron.weights import load_global

    setup_megatron(reuse.placement.ranks, reuse.placement.chunks_per_rank)
    config = transformer_config(**transformer_config_kwargs(reuse))
    model = build_chunks(_build, reuse, config=config)
    load_global(model, state, True)
    prepare_model(model, reuse)
    forward_backward = make_forward_backward_func(reuse, timeout_s=60)
    store = forward_backward(**step_kwargs("gpt", model, M))
    return {"losses": [s["lm loss"] for s in store], "grads": grads_by_name(model, True)}


@pytest.mark.parametrize(
    "reuse",
    [
        ReuseConfig(Placement(2, 2, "wave", "bi"), LAYERS),
        ReuseConfig(Placement(2, 2, "loop", "uni"), LAYERS, split_backward=True),
    ],
    ids=["wave-bi", "loop-uni-split"],
)
def test_prt_with_fused_norm_foreign_linears_matches_megatron(reuse):
    ref = all_ok(run_local(1, _reference))[0]
    results = all_ok(run_local(2, _prt, reuse, ref["state"]))
    fused = [n for n in ref["grads"] if ".linear_qkv.norm." in n or ".linear_fc1.norm." in n]
    assert len(fused) == 2 * 2 * LAYERS  # weight and bias of two fused norms per layer
    assert not any("input_layernorm" in n for n in ref["grads"])  # IdentityOp slots
    for rank, result in enumerate(results):
        if result["losses"]:
            torch.testing.assert_close(
                torch.stack(result["losses"]), torch.stack(ref["losses"]), rtol=1e-12, atol=0
            )
        for name, grads in result["grads"].items():
            want = ref["grads"][name]
            for grad in grads:
                err = ((grad - want).norm() / want.norm().clamp_min(1e-300)).item()
                assert err < 1e-10, (rank, name, err)
    assert results[-1]["losses"]


def _profile_parts(rank, world):
    from megatron_prt.megatron.profile import _measure, _single_rank

    with _single_rank("cpu", 1234):
        config = transformer_config(2)
        shape = (SEQ, MBS, VOCAB, "cpu")
        build = lambda config, vocab, seq: _build(config)  # noqa: E731
        return _measure(build, "gpt", config, shape, 1, lambda message: None)


def test_profiler_reads_the_structure_of_a_fused_norm_model():
    fwd, bwd, act, params = all_ok(run_local(1, _profile_parts))[0]
    assert set(act) == {"embedding", 0, 1, "head"}
    assert all(fwd[p] > 0 and bwd[p] > 0 for p in act)
    # a layer keeps its input (saved by the fused norm) among its activations, as with the
    # local spec's separate norm: the profile's per-layer bytes stay comparable
    assert act[0] == act[1] > SEQ * MBS * 16 * 8
    assert params[0] == params[1] == 12 * 16 * 16 + 13 * 16


def test_the_te_spec_is_refused_on_cpu_naming_the_fix(capsys):
    from megatron_prt.cli.main import main
    from megatron_prt.megatron.pretrain import build_model

    argv = ["profile", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "4"]
    argv += ["--seq-length", "8", "--micro-batch-size", "2", "--vocab-size", "64"]
    assert main([*argv, "--transformer-impl", "transformer_engine"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "use --transformer-impl local on CPU" in err
    assert main([*argv, "--recompute-granularity", "full"]) == 2  # megatron's rule, up front
    assert "--recompute-method uniform|block" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--transformer-impl transformer_engine needs CUDA"):
        build_model("gpt", None, VOCAB, SEQ, transformer_impl="transformer_engine")
