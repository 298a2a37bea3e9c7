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
