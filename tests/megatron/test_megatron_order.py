"""Order, seen from outside: megatron-core's model chunks are run forward and backward in
the plan's order, and the `interleaved` plan is megatron-core's own order (checked against
its schedule table and warm-up counts, read from megatron; tests may import megatron, the
package outside megatron_prt/megatron/ never does)."""

import itertools
from types import SimpleNamespace

import pytest

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")

import megatron_models as mm  # noqa: E402
import torch  # noqa: E402

from megatron_prt.core import Op, Placement, build_plan  # noqa: E402
from megatron_prt.core.schedules import megatron_schedule_table  # noqa: E402
from megatron_prt.megatron.config import ReuseConfig  # noqa: E402
from megatron_prt.runtime.local import all_ok, run_local  # noqa: E402


def _fake_communicator(p, rank, vp):
    group = SimpleNamespace(size=lambda: p, rank=lambda: rank)
    return SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vp)


CASES = [(p, r, k * p) for p, r, k in itertools.product((2, 3, 4, 8), (2, 3, 4), (1, 2, 3))]


@pytest.mark.parametrize("p, r, m", CASES)
def test_interleaved_is_megatrons_order(p, r, m):
    """Virtual micro-batch k runs megatron's table entry k forward and, with chunks
    mirrored, backward; megatron's warm-up forwards run before the first backward, and no
    more forwards than warm-up + 1 are ever in flight."""
    table = schedules.get_schedule_table(m, r, p)
    assert megatron_schedule_table(m, r, p) == table
    placement = Placement(p, r)
    plan = build_plan(placement, m, "interleaved")
    chunk = placement.stage_to_chunk
    for rank in range(p):
        actions = plan.ranks[rank]
        assert [(a.mb, chunk[a.stage]) for a in actions if a.op is Op.F] == table
        assert [(a.mb, r - 1 - chunk[a.stage]) for a in actions if a.op is Op.B] == table
        total, _, warmup, _ = schedules.get_pp_rank_microbatches(
            m, r, p, p2p_communicator=_fake_communicator(p, rank, r)
        )
        first_backward = next(i for i, a in enumerate(actions) if a.op is Op.B)
        assert first_backward == min(warmup + 1, total), rank
        in_flight = itertools.accumulate(1 if a.op is Op.F else -1 for a in actions)
        assert max(in_flight) == min(warmup + 1, total), rank


def _recorded_order(rank, world, reuse, m):
    """This rank's (op, chunk, mb) sequence as megatron's model chunks see it: a forward when
    forward_step_func runs a chunk, a backward when the gradient reaches the chunk's output."""
    from megatron_prt.megatron import make_forward_backward_func, prepare_model
    from megatron_prt.megatron.model import transformer_config_kwargs

    mm.setup_megatron(reuse.placement.ranks, reuse.placement.chunks_per_rank)
    config = mm.transformer_config(**transformer_config_kwargs(reuse))
    model = mm.model_chunks("gpt", config, reuse)
    prepare_model(model, reuse)
    chunk_of = {id(chunk): c for c, chunk in enumerate(model)}
    seen = []

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        c, mb = chunk_of[id(chunk)], int(batch["mb"])
        seen.append(("F", c, mb))
        out, loss_func = mm.forward_step("gpt", False, iter([batch]), chunk)
        out.register_hook(lambda grad: seen.append(("B", c, mb)))
        return out, loss_func

    tagged = [dict(batch, mb=torch.tensor(mb)) for mb, batch in enumerate(mm.batches(m))]
    make_forward_backward_func(reuse, timeout_s=60)(
        forward_step_func=forward_step,
        data_iterator=[iter(tagged) for _ in model],
        model=model,
        num_microbatches=m,
        seq_length=mm.SEQ,
        micro_batch_size=mm.MBS,
    )
    return seen


RUNS = [
    (Placement(2, 2, "loop"), "interleaved"),
    (Placement(2, 2, "wave"), "prt"),
    (Placement(2, 1, "loop", "bi"), "prt"),
]


@pytest.mark.parametrize("placement, schedule", RUNS, ids=str)
def test_megatron_chunks_run_in_the_plans_order(placement, schedule):
    m = 4
    reuse = ReuseConfig(placement, 4, schedule=schedule)
    seen = all_ok(run_local(placement.ranks, _recorded_order, reuse, m))
    plan = build_plan(placement, m, schedule=schedule)
    for rank, order in enumerate(seen):
        want = [(str(a.op), placement.stage_to_chunk[a.stage], a.mb) for a in plan.ranks[rank]]
        assert order == want, rank
