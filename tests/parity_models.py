"""Models for the parity tests: a layer list with deterministic per-layer initialisation."""

from __future__ import annotations

import torch

HIDDEN = 8
SEQ = 3
NUM_LAYERS = 12  # >= D for every configuration tested (R <= 3, P <= 4)


def make_layer(kind: str, index: int) -> torch.nn.Module:
    torch.manual_seed(1000 + index)  # every rank builds the same layer i
    if kind == "mlp":
        layer = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
    else:
        layer = torch.nn.TransformerEncoderLayer(
            HIDDEN, nhead=2, dim_feedforward=2 * HIDDEN, dropout=0.0, batch_first=True
        )
    return layer.double()


def batch(kind: str, m: int, mb_size: int = 2, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    shape = (mb_size, HIDDEN) if kind == "mlp" else (mb_size, SEQ, HIDDEN)
    xs = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(m)]
    ys = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(m)]
    return xs, ys


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def reference(kind: str, m: int, steps: int = 3, lr: float = 0.1):
    """Non-pipelined run: per-step losses, first-step grads and final params per layer."""
    layers = [make_layer(kind, i) for i in range(NUM_LAYERS)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    xs, ys = batch(kind, m)
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad()
        per_mb = [loss_fn(model(x), y) for x, y in zip(xs, ys, strict=True)]
        (sum(per_mb) / m).backward()
        losses.append([v.item() for v in per_mb])
        if step == 0:
            grads = [[p.grad.clone() for p in layer.parameters()] for layer in layers]
        opt.step()
    params = [[p.detach().clone() for p in layer.parameters()] for layer in layers]
    return losses, grads, params


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest relative difference of ``a`` from ``b`` (elementwise, scaled by ``b``'s max)."""
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


def train_errors(runtime, stages, placement, refs, xs, ys, steps, ranges) -> tuple[dict, set]:
    """Train ``steps`` SGD steps (lr 0.1) of ``stages`` through ``runtime`` on ``xs``/``ys``
    and compare with ``refs`` (from :func:`reference`): the largest relative error of the
    losses (every step), the gradients (first step) and the parameters (after the last), and
    the micro-batches whose loss this rank returned. ``ranges``: (first layer, count) per
    model stage."""
    params = [q for module in stages.values() for q in module.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    ref_losses, ref_grads, ref_params = refs
    err, seen = {"loss": 0.0, "grad": 0.0, "param": 0.0}, set()
    for step in range(steps):
        opt.zero_grad()
        losses = runtime.step(xs, ys)
        runtime.reduce_replica_grads()
        for mb, loss in enumerate(losses):
            if loss is not None:
                seen.add(mb)
                want = ref_losses[step][mb]
                err["loss"] = max(err["loss"], abs(float(loss) - want) / abs(want))
        if step == 0:
            for got, want in _layer_pairs(stages, placement, ranges, ref_grads):
                err["grad"] = max(err["grad"], rel_err(got.grad.cpu(), want))
        opt.step()
    for got, want in _layer_pairs(stages, placement, ranges, ref_params):
        err["param"] = max(err["param"], rel_err(got.detach().cpu(), want))
    return err, seen


def _layer_pairs(stages, placement, ranges, per_layer):
    """(parameter of this rank's layer, its reference tensor) for every local layer."""
    for stage, module in stages.items():
        first, _ = ranges[placement.model_stage(stage)]
        for offset, layer in enumerate(module):
            yield from zip(layer.parameters(), per_layer[first + offset], strict=True)


def check_grid_results(configs, results, tol: float, num_microbatches) -> None:
    """Every rank's ``(config, errors, micro-batches with a loss)`` per config (in order):
    every error within ``tol`` and, over the ranks, a loss for every micro-batch
    (``num_microbatches(config)``)."""
    for index, config in enumerate(configs):
        seen = set()
        for rank_results in results:
            got_config, err, rank_seen = rank_results[index]
            assert got_config == config
            seen |= rank_seen
            for what, value in err.items():
                assert value <= tol, f"{config}: {what} differs by {value:.3g}"
        m = num_microbatches(config)
        assert seen == set(range(m)), f"{config}: losses missing for some micro-batches"
