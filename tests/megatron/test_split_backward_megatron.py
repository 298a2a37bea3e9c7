"""megatron-core GPT and BERT with split backward (``--pipeline-reuse-split-backward``) equal
the same model without pipelining: losses to 1e-12, every gradient to 1e-10 relative
(float64), tied and untied, W at once, a few actions later or at the end of each rank; and
three steps of megatron's DDP + Adam track the unpipelined run."""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial

import pytest

pytest.importorskip("megatron.core")

import torch
from megatron_models import (
    LAYERS_TRAIN,
    assert_tracks_reference,
    grads_by_name,
    is_tied,
    model_chunks,
    setup_megatron,
    step_kwargs,
    train,
    transformer_config,
)
from test_megatron_parity import KINDS, M, _reference, _reuse
from test_megatron_training import TOL as TRAIN_TOL
from test_megatron_training import _unpipelined

from megatron_prt.core import Placement
from megatron_prt.core.actions import Op
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.megatron.weights import load_global
from megatron_prt.runtime.local import all_ok, run_local

W_DELAYS = (0, 2, None, "zb")  # "zb": core's zero-bubble plan (the default)


def _run_split(rank, world, kind, m, reuse, ref_state, w_delay):
    """This rank's split-backward run: losses (rank P-1), grads by global name, and how many
    layers deferred their weight GEMMs."""
    from megatron_prt.megatron import make_forward_backward_func, prepare_model
    from megatron_prt.megatron.model import transformer_config_kwargs
    from megatron_prt.megatron.split import enable_megatron_split_backward

    placement = reuse.placement
    setup_megatron(placement.ranks, placement.chunks_per_rank)
    config = transformer_config(**transformer_config_kwargs(reuse))
    model = model_chunks(kind, config, reuse)
    load_global(model, ref_state, is_tied(kind))
    prepare_model(model, reuse)
    forward_backward = make_forward_backward_func(reuse, timeout_s=60, w_delay=w_delay)
    store = forward_backward(**step_kwargs(kind, model, m))
    ops = {a.op for a in forward_backward.pipeline().plan.ranks[rank]}
    return {
        "losses": [s["lm loss"] for s in store],
        "grads": grads_by_name(model, is_tied(kind)),
        "ops": ops,
        "split_layers": enable_megatron_split_backward(model),
    }


def _check(kind, p, r, placement, direction, uneven, w_delay):
    reuse = dataclasses.replace(_reuse(p, r, placement, direction, uneven), split_backward=True)
    ref = _reference(kind, M)
    results = all_ok(
        run_local(p, _run_split, kind, M, reuse, ref["state"], w_delay, deadline_s=180)
    )
    losses = results[-1]["losses"]
    assert len(losses) == M
    for mb, (got, want) in enumerate(zip(losses, ref["losses"], strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, msg=f"loss of mb {mb}")
    seen = set()
    for rank, result in enumerate(results):
        assert result["ops"] == {Op.F, Op.I, Op.W}, f"rank {rank} ran {result['ops']}"
        assert result["split_layers"] > 0, f"rank {rank}: no layer defers its weight GEMM"
        for name, grads in result["grads"].items():
            want = ref["grads"][name]
            for grad in grads:
                err = ((grad - want).norm() / want.norm().clamp_min(1e-300)).item()
                assert err < 1e-10, f"rank {rank}: grad of {name} off by {err:.3g} relative"
            seen.add(name)
    assert seen == set(ref["grads"])


GRID = [
    (kind, p, r, placement, direction, uneven, W_DELAYS[i % len(W_DELAYS)])
    for i, (kind, (p, r), placement, direction, uneven) in enumerate(
        itertools.product(
            KINDS, [(2, 1), (2, 2), (2, 3), (4, 1), (4, 2)], ("loop", "wave"), ("uni", "bi"),
            (False, True),
        )
    )
]  # fmt: skip
SUBSET = [
    ("gpt", 2, 2, "wave", "uni", False, None),
    ("gpt-untied", 2, 3, "loop", "bi", True, 2),
    ("bert", 2, 2, "wave", "bi", True, 0),
    ("bert-nobinary", 2, 2, "loop", "uni", False, None),
    ("gpt", 4, 2, "wave", "bi", True, "zb"),
    ("bert", 2, 3, "loop", "uni", False, "zb"),
]


@pytest.mark.parametrize("kind,p,r,placement,direction,uneven,w_delay", SUBSET)
def test_split_parity_subset(kind, p, r, placement, direction, uneven, w_delay):
    _check(kind, p, r, placement, direction, uneven, w_delay)


@pytest.mark.slow
@pytest.mark.parametrize("kind,p,r,placement,direction,uneven,w_delay", GRID)
def test_split_parity_full_grid(kind, p, r, placement, direction, uneven, w_delay):
    _check(kind, p, r, placement, direction, uneven, w_delay)


def _train_split(rank, world, kind, m, reuse, state, w_delay):
    """megatron_models.train with W placed by ``w_delay`` (this forked rank alone)."""
    import megatron_prt.megatron as integration

    original = integration.make_forward_backward_func
    integration.make_forward_backward_func = partial(original, w_delay=w_delay)
    return train(rank, world, kind, m, reuse, state)


@pytest.mark.parametrize(
    "kind,placement,direction,w_delay",
    [("gpt", "wave", "uni", None), ("bert", "loop", "bi", "zb"), ("gpt", "loop", "uni", 2)],
)
def test_ddp_training_with_split_backward_tracks_the_reference(kind, placement, direction, w_delay):
    """megatron's DDP (grad buffers, main_grad hooks) sees every W's gradient: three Adam
    steps with clipping match the unpipelined run."""
    reuse = ReuseConfig(Placement(2, 2, placement, direction), LAYERS_TRAIN, split_backward=True)
    state, want = _unpipelined(kind)
    results = all_ok(run_local(2, _train_split, kind, M, reuse, state, w_delay))
    assert_tracks_reference(results, want, TRAIN_TOL)


def _freed_without_the_collector(rank, world, kind):
    """Whether a split-capable model's parallel linears die with their last reference."""
    import gc
    import weakref

    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_prt.megatron.model import transformer_config_kwargs
    from megatron_prt.megatron.split import enable_megatron_split_backward

    reuse = _reuse(2, 1, "loop", "uni", False)
    setup_megatron(2, None)
    model = model_chunks(kind, transformer_config(**transformer_config_kwargs(reuse)), reuse)
    count = enable_megatron_split_backward(model)
    assert enable_megatron_split_backward(model) == count  # idempotent
    linear = next(m for m in model[0].modules() if isinstance(m, ColumnParallelLinear))
    alive = weakref.ref(linear)
    gc.disable()
    try:
        del model, linear
        return count, alive() is None
    finally:
        gc.enable()


def test_split_capable_megatron_layers_are_freed_without_the_cyclic_collector():
    """megatron's parallel linears kept a partial of their own bound method on themselves:
    a reference cycle, so a model out of scope waited for the cyclic collector."""
    for count, freed in all_ok(run_local(2, _freed_without_the_collector, "gpt")):
        assert count > 0 and freed
