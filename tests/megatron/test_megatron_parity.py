"""megatron-core GPT and BERT under PRT equal the same model without pipelining.

Every configuration runs on 2-4 forked gloo ranks with megatron_prt's forward-backward
function and is compared with megatron's own no-pipelining schedule on one rank, same
weights, same data. The models run in float64, so the only differences are the order in
which micro-batch gradients are summed (a few ulps): losses must match to 1e-12 and every
parameter gradient to 1e-10 relative (a dropped, doubled or misplaced micro-batch, layer or
tied-weight gradient is off by order 1).
"""

from __future__ import annotations

import functools
import itertools

import pytest

pytest.importorskip("megatron.core")

import torch
from megatron_models import reference, run_prt

from megatron_prt.core import Placement
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.runtime.local import all_ok, run_local

LAYERS = 8
M = 4
UNEVEN = {2: (5, 3), 4: (1, 3, 2, 2), 6: (2, 1, 1, 2, 1, 1), 8: (1,) * 8}
KINDS = ("gpt", "gpt-untied", "bert", "bert-nobinary")


@functools.cache
def _reference(kind: str, m: int, per_token: bool = False, variable: bool = False):
    return all_ok(run_local(1, reference, kind, LAYERS, m, per_token, variable))[0]


def _reuse(p, r, placement, direction, uneven):
    counts = UNEVEN[p * r] if uneven else None
    return ReuseConfig(Placement(p, r, placement, direction), LAYERS, counts)


def _check(kind, reuse, m=M, forward_only=False, per_token=False, variable=False, transport="auto"):
    ref = _reference(kind, m, per_token, variable)
    p = reuse.placement.ranks
    results = all_ok(
        run_local(
            p,
            run_prt,
            kind,
            m,
            reuse,
            ref["state"],
            forward_only,
            per_token,
            variable,
            transport,
            deadline_s=120,
        )
    )
    losses = results[-1]["losses"]
    assert len(losses) == m, f"rank P-1 holds {len(losses)} loss entries for {m} micro-batches"
    for mb, (got, want) in enumerate(zip(losses, ref["losses"], strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, msg=f"loss of mb {mb}")
    assert all(r["losses"] == [] for r in results[:-1]), "losses returned off rank P-1"
    seen = set()
    for rank, result in enumerate(results):
        for name, grads in result["grads"].items():
            want = ref["grads"][name]
            for grad in grads:
                if forward_only:
                    assert not grad.any(), f"rank {rank}: forward-only left a grad in {name}"
                    continue
                err = ((grad - want).norm() / want.norm().clamp_min(1e-300)).item()
                assert err < 1e-10, f"rank {rank}: grad of {name} off by {err:.3g} relative"
            seen.add(name)
    assert seen == set(ref["grads"]), f"parameters no rank holds: {set(ref['grads']) - seen}"


GRID = [
    (kind, p, r, placement, direction, uneven)
    for kind, (p, r), placement, direction, uneven in itertools.product(
        KINDS, [(2, 1), (2, 2), (2, 3), (4, 1), (4, 2)], ("loop", "wave"), ("uni", "bi"),
        (False, True)
    )
]  # fmt: skip
# A subset for `make test` that still crosses every knob: both models, tied and untied,
# loop and wave (even R puts the last stage on rank 0), uni and bi, uneven stages, P=4.
SUBSET = [
    ("gpt", 2, 2, "wave", "uni", False),
    ("gpt-untied", 2, 3, "loop", "bi", True),
    ("bert", 2, 2, "wave", "bi", True),
    ("bert", 2, 3, "loop", "uni", False),
    ("bert-nobinary", 4, 2, "wave", "uni", True),
    ("gpt", 2, 1, "loop", "bi", False),
]


@pytest.mark.parametrize("kind,p,r,placement,direction,uneven", SUBSET)
def test_parity_subset(kind, p, r, placement, direction, uneven):
    _check(kind, _reuse(p, r, placement, direction, uneven))


@pytest.mark.slow
@pytest.mark.parametrize("kind,p,r,placement,direction,uneven", GRID)
def test_parity_full_grid(kind, p, r, placement, direction, uneven):
    _check(kind, _reuse(p, r, placement, direction, uneven))


@pytest.mark.parametrize("kind,direction", [("bert", "bi"), ("gpt", "uni")])
def test_forward_only_matches_and_leaves_no_grads(kind, direction):
    _check(kind, _reuse(2, 2, "wave", direction, False), forward_only=True)


@pytest.mark.parametrize("direction", ["uni", "bi"])
def test_per_token_loss_and_odd_microbatch_count(direction):
    """(loss, num_tokens, dict) losses; token counts reach rank P-1 from every last stage."""
    _check("gpt", _reuse(2, 2, "wave", direction, True), m=5, per_token=True)


@pytest.mark.parametrize("kind,transport", [("bert", "torch"), ("gpt", "shm")])
def test_variable_sequence_lengths(kind, transport):
    """config.variable_seq_lengths: activation shapes differ between micro-batches."""
    _check(kind, _reuse(2, 2, "wave", "bi", False), variable=True, transport=transport)


@pytest.mark.parametrize(
    "counts,placement,direction", [((3, 0, 3, 2), "loop", "uni"), ((3, 2, 0, 3), "wave", "bi")]
)
def test_a_stage_without_layers(counts, placement, direction):
    """Partitions may leave a middle stage empty: it only hands its input on."""
    _check("bert", ReuseConfig(Placement(2, 2, placement, direction), LAYERS, counts))
