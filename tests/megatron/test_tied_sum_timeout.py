"""The tied embedding/output gradient sum after the schedule waits for its peer no longer
than the schedule's own waits (``timeout_s``, the runtime's ``--pipeline-reuse-timeout``):
it waited the process group's timeout (Megatron-LM's default: 10 minutes) for a peer that
had failed or stopped after the step."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("megatron.core")

import torch

from megatron_prt.core import Placement
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.runtime.local import run_local

# Below the local group's own timeout (60 s): a wait bounded only by the group's timeout
# leaves the waiting rank running past it, reported "killed" instead of raising.
DEADLINE_S = 40


class _Tied(torch.nn.Module):
    """A chunk that shares its word embedding with its output layer (megatron's contract)."""

    share_embeddings_and_output_weights = True

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.weight.grad = torch.full((4,), 1.0)

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        return self.weight


def _sum(rank, world, peer_joins: bool):
    import torch.distributed as dist

    from megatron_prt.megatron.model import tie_grads

    reuse = ReuseConfig(Placement(2), 2)
    stages = {rank: _Tied()}
    stages[rank].weight.grad.fill_(rank + 1.0)
    if rank == 1 and not peer_joins:
        time.sleep(600)  # alive, past the step, never summing (killed once rank 0 reports)
        return None
    try:
        tie_grads(reuse, stages, dist.group.WORLD, "grad", timeout_s=2.0)
    except RuntimeError as exc:
        return ("raised", str(exc).splitlines()[0])
    return ("summed", stages[rank].weight.grad.tolist())


def test_the_tied_sum_adds_both_gradients():
    results = run_local(2, _sum, True, deadline_s=120)
    assert [r for _, r in results] == [("summed", [3.0] * 4)] * 2


def test_the_tied_sum_waits_no_longer_than_the_timeout():
    results = run_local(2, _sum, False, deadline_s=DEADLINE_S, wait_for=[0])
    status, outcome = results[0]
    assert status == "ok" and outcome[0] == "raised", results
    assert "the tied embedding gradient sum failed: rank(s) [1]" in outcome[1], outcome


def _gather(rank, world, sender_sends: bool):
    import torch.distributed as dist

    from megatron_prt.megatron.losses import gather_on_last_rank

    reuse = ReuseConfig(Placement(2, 2, "wave"), 4)  # the last stage is on rank 0
    store = {mb: {"lm loss": torch.tensor([float(mb), 1.0])} for mb in range(4)} if not rank else {}
    tokens = torch.tensor(4 if not rank else 0)
    if rank == 0 and not sender_sends:
        time.sleep(600)
        return None
    try:
        entries, tokens = gather_on_last_rank(
            reuse, dist.group.WORLD, store, tokens, torch.device("cpu"), timeout_s=2.0
        )
    except RuntimeError as exc:
        return ("raised", str(exc).splitlines()[0])
    return ("gathered", [e["lm loss"].tolist() for e in entries], int(tokens))


def test_the_losses_reach_the_last_rank():
    results = run_local(2, _gather, True, deadline_s=120)
    assert results[0][1][:2] == ("gathered", [])  # the sender keeps no entries
    assert results[1] == ("ok", ("gathered", [[float(mb), 1.0] for mb in range(4)], 4))


def test_the_loss_gather_waits_no_longer_than_the_timeout():
    """It waited the process group's timeout for a sender stuck after the step."""
    results = run_local(2, _gather, False, deadline_s=DEADLINE_S, wait_for=[1])
    status, outcome = results[1]
    assert status == "ok" and outcome[0] == "raised", results
    assert "waiting on rank 0 for the losses" in outcome[1], outcome
