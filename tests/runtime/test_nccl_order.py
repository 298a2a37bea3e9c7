"""Receives posted early under NCCL's ordering (:mod:`megatron_prt.runtime.ordered`): the
checker proves every generated plan deadlock-free with the early posting, and gloo runs of
the early program give the non-pipelined losses and gradients."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from ordered_transport import StreamOrderedTransport
from parity_models import NUM_LAYERS, batch, loss_fn, make_layer, reference

from megatron_prt.core import Placement, build_plan
from megatron_prt.core.actions import Op
from megatron_prt.core.lower import lower
from megatron_prt.runtime import PipelineRuntime, build_stages, ordered
from megatron_prt.runtime.local import all_ok, run_local
from megatron_prt.runtime.ordered import nccl_stuck, post_recvs_early
from megatron_prt.runtime.split_plan import split_backward_plan
from megatron_prt.runtime.stages import layer_ranges
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.posting import compute_makespan
from megatron_prt.sim.simulate import simulate

RECVS = (Op.RECV_F, Op.RECV_B)
KINDS = [
    ("loop", "uni", "prt"),
    ("wave", "uni", "prt"),
    ("loop", "bi", "prt"),
    ("wave", "bi", "prt"),
    ("loop", "uni", "zb"),
    ("wave", "uni", "zb"),
]


def _grid():
    for p in range(1, 6):
        for r in (1, 2, 3):
            for placement, direction, schedule in KINDS:
                for m in range(2 if direction == "bi" else 1, 2 * p + 2):
                    yield p, r, placement, direction, schedule, m


def _moved(before, after) -> tuple[int, int]:
    """(receives posted earlier, receives) over all ranks; checks what may move and how."""
    moved = total = 0
    for old, new in zip(before.ranks, after.ranks, strict=True):
        assert sorted(old) == sorted(new), "the pass only reorders a rank's actions"
        assert [a for a in old if a.op not in RECVS] == [a for a in new if a.op not in RECVS]
        for action in old:
            if action.op in RECVS:
                total += 1
                hops = sum(a.op.is_compute for a in old[new.index(action) : old.index(action)])
                assert hops <= 1, f"{action} moved over {hops} computes"
                moved += hops
    return moved, total


@pytest.mark.parametrize("placement,direction,schedule", KINDS)
def test_every_plan_completes_under_nccl_ordering(placement, direction, schedule):
    plans = moved = total = 0
    for p, r, pl, d, s, m in _grid():
        if (pl, d, s) != (placement, direction, schedule):
            continue
        lowered = lower(build_plan(Placement(p, r, pl, d), m, s))
        if s == "prt" and d == "uni" and r == 2:  # the runtime's split of a F/B plan too
            split = lower(split_backward_plan(build_plan(Placement(p, r, pl, d), m, s)))
            assert not nccl_stuck(post_recvs_early(split)), (p, r, pl, d, "split", m)
        assert not nccl_stuck(lowered), (p, r, pl, d, s, m)
        early = post_recvs_early(lowered)
        assert not nccl_stuck(early), (p, r, pl, d, s, m)
        got = _moved(lowered, early)
        moved, total, plans = moved + got[0], total + got[1], plans + 1
    assert plans > 0 and (total == 0 or moved > 0)
    print(f"{placement}/{direction}/{schedule}: {plans} plans, {moved} of {total} receives early")


def _one_by_one(plan):
    """The reference rule: each candidate receive in plan order, kept if the plan with it
    and the ones kept before still completes (one whole-plan check per receive)."""
    ends = ordered._ends(plan)
    kept, current, moves = set(), plan, ordered._causal_moves(plan, ends)
    for rank, stream in enumerate(plan.ranks):
        for action in stream:
            if (rank, action) in moves:
                trial = ordered._apply(plan, kept | {(rank, action)}, ends)
                if trial.ranks != current.ranks and not nccl_stuck(trial):
                    kept, current = kept | {(rank, action)}, trial
    return current


@pytest.mark.parametrize(
    "p", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)]
)
def test_the_fast_pass_keeps_the_moves_of_the_one_by_one_rule(p):
    for _, r, placement, direction, schedule, m in (g for g in _grid() if g[0] == p):
        plan = lower(build_plan(Placement(p, r, placement, direction), m, schedule))
        assert post_recvs_early(plan).ranks == _one_by_one(plan).ranks, (p, r, m, direction)


def test_the_checker_finds_the_deadlock_of_receives_posted_first():
    stuck = nccl_stuck(_receives_first_plan())
    assert set(stuck) == {0, 1}, stuck  # rank 0's sends wait behind its gradient receives


def test_1f1b_steady_state_posts_the_next_gradient_with_the_current_send():
    plan = lower(build_plan(Placement(4, 1), 8, "1f1b"))
    early = post_recvs_early(plan)
    moved, _ = _moved(plan, early)
    assert moved > 0
    assert not nccl_stuck(early)


def _worker(rank, world, configs):
    out = []
    for r, placement, direction, m, split in configs:
        plan = build_plan(Placement(world, r, placement, direction), m)
        stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), NUM_LAYERS)
        runtime = PipelineRuntime(
            plan,
            stages,
            loss_fn,
            dtype=torch.float64,
            timeout_s=30,
            transport="torch",
            recv_lookahead=0,
            early_recvs=True,
            split_backward=split,
        )
        runtime.transport = StreamOrderedTransport(runtime.transport)
        xs, ys = batch("mlp", m)
        steps = []
        for _ in range(2):  # the first runs the plan's order and learns the shapes
            for module in stages.values():
                module.zero_grad()
            losses = runtime.step(xs, ys)
            grads = {s: [q.grad.clone() for q in mod.parameters()] for s, mod in stages.items()}
            steps.append((losses, grads))
        assert all(map(runtime.transport.knows, runtime._early[False][2])), "early unused"
        assert runtime.transport.batches > 0
        out.append(steps)
        runtime.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_early_receives_keep_parity(world):
    configs = [(2, "loop", "uni", 2 * world + 1, False), (2, "wave", "uni", world, True)]
    results = all_ok(run_local(world, _worker, configs, deadline_s=600))
    for index, (r, _, _, m, _) in enumerate(configs):
        ref_losses, ref_grads, _ = reference("mlp", m, steps=1)
        ranges = layer_ranges(NUM_LAYERS, world * r)
        for rank_results in results:
            for losses, grads in rank_results[index]:
                for mb, loss in enumerate(losses):
                    if loss is not None:
                        assert abs(float(loss) - ref_losses[0][mb]) <= 1e-10 * abs(
                            ref_losses[0][mb]
                        )
                for stage, stage_grads in grads.items():
                    first, count = ranges[stage]
                    want = [g for layer in ref_grads[first : first + count] for g in layer]
                    for got, ref in zip(stage_grads, want, strict=True):
                        err = float((got - ref).abs().max() / max(float(ref.abs().max()), 1e-30))
                        assert err <= 1e-10, (configs[index], stage)


def _receives_first_worker(rank, world, ordered):
    """Runs 1F1B with every receive of a rank posted before its first compute."""
    plan = build_plan(Placement(world, 1), 4, "1f1b")
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), NUM_LAYERS)
    runtime = PipelineRuntime(
        plan,
        stages,
        loss_fn,
        dtype=torch.float64,
        timeout_s=3,
        transport="torch",
        recv_lookahead=0,
        early_recvs=True,
    )
    bad = _receives_first_plan()
    runtime._early[False] = (bad, *runtime._compile(bad.ranks[rank]))
    if ordered:
        runtime.transport = StreamOrderedTransport(runtime.transport)
    xs, ys = batch("mlp", 4)
    runtime.step(xs, ys)  # the plan's order: learns the shapes
    try:
        runtime.step(xs, ys)
    except Exception as exc:  # the outcome is what the test checks
        return type(exc).__name__
    finally:
        runtime.close()
    return None


def test_the_ordered_transport_deadlocks_where_nccl_would():
    gloo = all_ok(run_local(2, _receives_first_worker, False, deadline_s=120))
    assert gloo == [None, None]  # gloo's messages are independent: no deadlock
    ordered = all_ok(run_local(2, _receives_first_worker, True, deadline_s=120))
    assert ordered == ["PipelineError", "PipelineError"], ordered


def _receives_first_plan():
    """2-rank 1F1B (m=4), lowered, with each rank's receives moved to its front."""
    plan = lower(build_plan(Placement(2, 1), 4, "1f1b"))
    first = (tuple(sorted(stream, key=lambda a: a.op not in RECVS)) for stream in plan.ranks)
    return replace(plan, ranks=tuple(first))


def test_early_receives_price_a_split_plan_in_its_own_form():
    """compute_makespan priced a split-backward plan at the whole form's times while
    simulate took the split form's ([Note: the split form's own costs])."""
    plan = build_plan(Placement(4, 2), 8, "zb")
    layer = LayerCost(1.0, 2.0, wgrad=1.0, split_fwd=1.5, split_bwd=3.0)
    cost = CostModel(layers=(layer,) * 8, p2p_latency=0.05)
    early = compute_makespan(plan, cost, "early")
    assert early == pytest.approx(simulate(plan, cost).makespan, rel=1e-9)


@pytest.mark.parametrize("reuse,schedule", [(1, "1f1b"), (2, "prt"), (2, "zb")])
def test_the_simulator_models_early_receives_and_at_need_costs_more(reuse, schedule):
    plan = build_plan(Placement(4, reuse), 8, schedule)
    cost = CostModel(fwd_time=8.0, bwd_time=16.0, p2p_latency=0.05)
    early = compute_makespan(plan, cost, "early")
    assert early == pytest.approx(simulate(plan, cost).makespan, rel=1e-9)
    one_ahead = compute_makespan(plan, cost, "one_ahead")
    assert early <= one_ahead < compute_makespan(plan, cost, "at_need")  # hops not hidden
    free = CostModel(fwd_time=8.0, bwd_time=16.0)
    for posting in ("one_ahead", "at_need"):
        assert compute_makespan(plan, free, posting) == pytest.approx(
            compute_makespan(plan, free, "early"), rel=1e-12
        )
