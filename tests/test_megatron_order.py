"""The `interleaved` baseline reproduces megatron-core's own order, and PRT loop matches
its bubble. Reads megatron-core's schedule table and warm-up counts (tests may import
megatron; the package outside megatron_prt/megatron/ never does)."""

import itertools
from types import SimpleNamespace

import pytest

from megatron_prt.core import Action, Op, Placement, build_plan
from megatron_prt.core.schedules import megatron_schedule_table

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")


def _fake_communicator(p, rank, vp):
    group = SimpleNamespace(size=lambda: p, rank=lambda: rank)
    return SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp)


def megatron_order(p, r, m, rank):
    """Rebuild a rank's compute order the way forward_backward_pipelining_with_interleaving
    walks it: warm-up forwards, then (forward k+W, backward k) pairs, then the rest."""
    table = schedules.get_schedule_table(m, r, p)
    total, _, warmup, _ = schedules.get_pp_rank_microbatches(
        m, r, p, p2p_communicator=_fake_communicator(p, rank, r)
    )
    fwd = [Action(c * p + rank, Op.F, mb) for mb, c in table]
    bwd = [Action((r - 1 - c) * p + rank, Op.B, mb) for mb, c in table]
    order = fwd[:warmup]
    for k in range(total - warmup):
        order += [fwd[k + warmup], bwd[k]]
    return order + bwd[total - warmup :]


CASES = [(p, r, k * p) for p, r, k in itertools.product((2, 3, 4, 8), (2, 3, 4), (1, 2, 3))]


@pytest.mark.parametrize("p, r, m", CASES)
def test_interleaved_equals_megatron(p, r, m):
    assert megatron_schedule_table(m, r, p) == schedules.get_schedule_table(m, r, p)
    plan = build_plan(Placement(p, r), m, "interleaved")
    for rank in range(p):
        assert list(plan.ranks[rank]) == megatron_order(p, r, m, rank)
