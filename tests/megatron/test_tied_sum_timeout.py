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
        time.sleep(20)  # alive, past the step, never summing
        return None
    start = time.monotonic()
    try:
        tie_grads(reuse, stages, dist.group.WORLD, "grad", timeout_s=2.0)
    except RuntimeError as exc:
        return ("raised", time.monotonic() - start, str(exc).splitlines()[0])
    return ("summed", stages[rank].weight.grad.tolist())


def test_the_tied_sum_adds_both_gradients():
    results = run_local(2, _sum, True, deadline_s=120)
    assert [r for _, r in results] == [("summed", [3.0] * 4)] * 2


def test_the_tied_sum_waits_no_longer_than_the_timeout():
    results = run_local(2, _sum, False, deadline_s=120, wait_for=[0])
    status, outcome = results[0]
    assert status == "ok" and outcome[0] == "raised", results
    assert outcome[1] < 15, outcome  # bounded by timeout_s, not the group's
