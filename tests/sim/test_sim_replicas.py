"""The bi replica-gradient sum in the simulator: free by default, exact on hand-checked
cases, and paired and sized as the runtime pairs and sizes it."""

import json
import math

import pytest

from megatron_prt.core import Placement, build_plan
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate

BI_CASES = [
    (Placement(2, 1, "loop", "bi"), 2),
    (Placement(3, 2, "wave", "bi"), 4),
    (Placement(4, 2, "loop", "bi"), 5),
]


def _last_compute_end(result, rank: int) -> float:
    return max(result.timeline.end[a] for a in result.plan.compute_actions(rank))


@pytest.mark.parametrize("placement, m", BI_CASES)
def test_sum_is_free_by_default(placement, m):
    result = simulate(build_plan(placement, m), CostModel(param_bytes=64.0))
    assert result.makespan == result.timeline.makespan
    assert result.replica_sync_time == 0.0
    assert all(r.replica_sync == 0.0 for r in result.per_rank)
    assert result.replica_bytes > 0  # the traffic is counted even when it is free


def test_bi_makespan_grows_by_the_exchange_time():
    # Chimera P=2, m=2, forward 1 / backward 2 per stage. Rank 0 holds stages 0 and 3,
    # rank 1 stages 1 and 2 (pipeline 1 mirrored); mb 0 runs on pipeline 0, mb 1 on 1:
    #   rank 0: 0F0 [0,1]  3F1 [1,2]  3B1 [2,4]  0B0 [4,6]
    #   rank 1: 2F1 [0,1]  1F0 [1,2]  1B0 [2,4]  2B1 [4,6]
    # Both finish at 6. Gradients: 64 param bytes / 4 = 16 for the model, 8 per model
    # stage; each rank sends its two stages' 16 bytes to the other and adds 16 received:
    # 0.5 latency + 16 / 8 transfer + 16 / 32 add = 3.
    plan = build_plan(Placement(2, 1, "loop", "bi"), 2)
    assert [" ".join(map(str, acts)) for acts in plan.ranks] == [
        "0F0 3F1 3B1 0B0",
        "2F1 1F0 1B0 2B1",
    ]
    cost = CostModel(
        fwd_time=2.0,
        bwd_time=4.0,
        param_bytes=64.0,
        replica_latency=0.5,
        replica_bandwidth=8.0,
        replica_add_bandwidth=32.0,
    )
    result = simulate(plan, cost)
    assert result.timeline.makespan == pytest.approx(6.0)
    assert result.makespan == pytest.approx(9.0)
    assert result.replica_sync_time == pytest.approx(3.0)
    assert result.replica_bytes == pytest.approx(32.0)
    assert [(r.replica_bytes, r.replica_wait) for r in result.per_rank] == [(16.0, 0), (16.0, 0)]
    assert [r.replica_sync for r in result.per_rank] == pytest.approx([3.0, 3.0])
    assert [r.busy for r in result.per_rank] == pytest.approx([6.0, 6.0])
    assert result.bubble_fraction == pytest.approx(3.0 / 9.0)  # the sum is not compute


@pytest.mark.parametrize("placement, m", BI_CASES)
def test_each_pair_starts_when_its_later_rank_is_done(placement, m):
    latency = 0.7
    result = simulate(build_plan(placement, m), CostModel(replica_latency=latency))
    p = placement.ranks
    ends = []
    for rank, stats in enumerate(result.per_rank):
        mirror = p - 1 - rank
        own, theirs = _last_compute_end(result, rank), _last_compute_end(result, mirror)
        if mirror == rank:  # odd P, middle rank: both replicas local, no exchange
            assert (stats.replica_wait, stats.replica_sync) == (0.0, 0.0)
            ends.append(own)
            continue
        assert stats.replica_wait == pytest.approx(max(own, theirs) - own)
        assert stats.replica_sync == pytest.approx(latency)
        ends.append(max(own, theirs) + latency)
    assert result.makespan == pytest.approx(max(ends))


def test_odd_middle_rank_only_adds_its_local_replicas():
    # P=3, R=1: the middle rank holds model stage 1 twice (stages 1 and 4). Model grads
    # 30 bytes over 3 stages: 10 per stage. Ranks 0 and 2 exchange stages {0, 5} / {2, 3}
    # (model stages 0 and 2): 20 bytes each way; rank 1 adds its 10 bytes in place.
    cost = CostModel(grad_bytes=30.0, replica_latency=1.0, replica_add_bandwidth=5.0)
    result = simulate(build_plan(Placement(3, 1, "loop", "bi"), 4), cost)
    outer, middle, _ = result.per_rank
    assert middle.replica_bytes == 0.0 and middle.replica_sync == pytest.approx(10.0 / 5.0)
    assert outer.replica_bytes == 20.0 and outer.replica_sync == pytest.approx(1.0 + 20.0 / 5.0)


def test_uni_plans_are_unaffected():
    cost = CostModel(param_bytes=64.0)
    expensive = CostModel(param_bytes=64.0, replica_latency=5.0, replica_bandwidth=1.0)
    for placement in (Placement(3, 2, "loop"), Placement(3, 2, "wave")):
        plan = build_plan(placement, 4)
        free, paid = simulate(plan, cost), simulate(plan, expensive)
        assert paid.makespan == free.makespan and paid.per_rank == free.per_rank
        assert paid.replica_sync_time == 0.0 and paid.replica_bytes == 0.0


@pytest.mark.parametrize("placement", ["loop", "wave"])
@pytest.mark.parametrize("ranks, reuse", [(2, 1), (3, 2), (4, 2)])
def test_bytes_and_peers_match_the_runtime(ranks, reuse, placement):
    """Drive the runtime's replica sum through a recording transport: every rank sends the
    simulator's bytes to the simulator's peer, which is the runtime's ``replica_peers``."""
    torch = pytest.importorskip("torch")
    from megatron_prt.runtime.replicas import reduce_replica_grads_shm, replica_peers

    pl = Placement(ranks, reuse, placement, "bi")
    numel = [k + 1 for k in range(pl.depth)]  # model stage k: k + 1 float32 weights
    cost = CostModel(layers=tuple(LayerCost(1.0, 2.0, grad=4.0 * n) for n in numel))
    result = simulate(build_plan(pl, 2), cost)
    for rank, stats in enumerate(result.per_rank):
        stages = {
            s: torch.nn.Linear(numel[pl.model_stage(s)], 1, bias=False)
            for s in pl.rank_stages[rank]
        }
        transport = _RecordingTransport(pl)
        reduce_replica_grads_shm(pl, stages, transport, rank)
        assert stats.replica_bytes == transport.sent_bytes
        assert transport.peers == replica_peers(pl, rank)
        assert transport.peers == ({ranks - 1 - rank} if stats.replica_bytes else set())


class _RecordingTransport:
    """Stands in for the shared-memory transport: records sends, answers every receive
    with zeros of the size just sent (the peer's gradient is as long as this rank's)."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.sent_bytes = 0
        self.peers: set[int] = set()
        self._last = None

    def send(self, key, tensor) -> None:
        _, _, to_stage, _ = key
        self.peers.add(self.placement.rank_of(to_stage))
        self.sent_bytes += tensor.numel() * tensor.element_size()
        self._last = tensor

    def recv(self, key):
        return key

    def rank_of_stage(self, stage: int) -> int:
        return self.placement.rank_of(stage)

    def pair_bytes(self, peer: int) -> int:
        return 1 << 20

    def wait(self, handle):
        return self._last.new_zeros(self._last.shape)


def test_cost_json_stays_compatible():
    old = {"fwd_time": 3.0, "bwd_time": 6.0, "param_bytes": 32.0, "p2p_bandwidth": None}
    cost = CostModel.from_dict(old)
    assert cost.whole_grad_bytes == 8.0 and not cost.has_replica_cost
    written = cost.to_dict()  # new keys at their defaults stay out of the file
    assert not {"grad_bytes", "replica_latency", "replica_bandwidth"} & set(written)
    assert "grad" not in CostModel(layers=(LayerCost(1, 2, param=16),)).to_dict()["layers"][0]
    new = CostModel(
        layers=(LayerCost(1, 2, param=16, grad=2),),
        grad_bytes=5.0,
        replica_latency=0.1,
        replica_bandwidth=1e9,
    )
    again = CostModel.from_dict(json.loads(json.dumps(new.to_dict())))
    assert again == new and math.isinf(again.replica_add_bandwidth)
    assert new.stage_grad_bytes(Placement(1)) == (2.0,)  # per-layer grad wins over the total
    nulls = CostModel.from_dict({"replica_bandwidth": None, "replica_add_bandwidth": None})
    assert not nulls.has_replica_cost


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"replica_latency": -1}, "replica_latency"),
        ({"replica_bandwidth": 0}, "replica_bandwidth"),
        ({"grad_bytes": -2}, "grad_bytes"),
        ({"layers": [{"fwd": 1, "bwd": 2, "grad": -1}]}, "grad"),
        # ignored beside layers without grad: the replica sum priced at param / 4 each
        (
            {"layers": [{"fwd": 1, "bwd": 2, "param": 8}], "grad_bytes": 4e9},
            "cost layers give no grad, so grad_bytes",
        ),
    ],
)
def test_bad_replica_costs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        CostModel.from_dict(bad)
    # a profile's total beside layers that give grad stays accepted
    CostModel.from_dict({"layers": [{"fwd": 1, "bwd": 2, "grad": 2}], "grad_bytes": 2})


# -- calibration helper (runtime side) -----------------------------------------------------
def _time_sync(rank, world, transport):
    import torch

    from megatron_prt.runtime import PipelineRuntime, sync_replicas
    from megatron_prt.runtime.replica_timing import time_replica_sync

    torch.manual_seed(rank)
    plan = build_plan(Placement(world, 1, "loop", "bi"), 2)
    stages = {s: torch.nn.Linear(4, 4) for s in plan.placement.rank_stages[rank]}
    sync_replicas(plan.placement, stages)
    runtime = PipelineRuntime(plan, stages, torch.nn.functional.mse_loss, transport=transport)
    try:
        xs = [torch.randn(3, 4) for _ in range(2)]
        runtime.step(xs, [torch.zeros(3, 4)] * 2)
        before = [p.grad.clone() for s in stages.values() for p in s.parameters()]
        seconds = time_replica_sync(runtime, repeats=3)
        after = [p.grad for s in stages.values() for p in s.parameters()]
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        runtime.reduce_replica_grads()  # the transport still works: replicas now agree
        summed = {s: [p.grad.tolist() for p in m.parameters()] for s, m in stages.items()}
        return seconds, unchanged, summed
    finally:
        runtime.close()


@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_time_replica_sync_measures_without_touching_gradients(transport):
    pytest.importorskip("torch")
    from megatron_prt.runtime.local import all_ok, run_local

    (t0, same0, grads0), (t1, same1, grads1) = all_ok(run_local(2, _time_sync, transport))
    assert t0 > 0 and t1 > 0 and same0 and same1
    # P=2, R=1: rank 0 holds stages 0 and 3, rank 1 their replicas 2 and 1
    assert grads0[0] == grads1[2] and grads0[3] == grads1[1]


def _time_after_a_sum(rank, world):
    import torch

    from megatron_prt.runtime import PipelineRuntime, executor, sync_replicas
    from megatron_prt.runtime.replica_timing import time_replica_sync

    torch.manual_seed(rank)
    plan = build_plan(Placement(world, 1, "loop", "bi"), 2)
    stages = {s: torch.nn.Linear(4, 4) for s in plan.placement.rank_stages[rank]}
    sync_replicas(plan.placement, stages)
    runtime = PipelineRuntime(plan, stages, torch.nn.functional.mse_loss, transport="torch")
    calls = []
    inner = executor.reduce_replica_grads
    executor.reduce_replica_grads = lambda *a, **k: calls.append(1) or inner(*a, **k)
    try:
        runtime.step([torch.randn(3, 4) for _ in range(2)], [torch.zeros(3, 4)] * 2)
        runtime.reduce_replica_grads()  # as a bi training step ends
        summed = [p.grad.clone() for s in stages.values() for p in s.parameters()]
        before = len(calls)
        time_replica_sync(runtime, repeats=3)
        timed = len(calls) - before
        runtime.reduce_replica_grads()  # no step since the sum: returns at once
        after = [p.grad for s in stages.values() for p in s.parameters()]
        return timed, all(torch.equal(a, b) for a, b in zip(summed, after, strict=True))
    finally:
        executor.reduce_replica_grads = inner
        runtime.close()


def test_time_replica_sync_after_a_sum_times_every_repetition_and_keeps_the_sum():
    """After a step's sum, the first repetition returned at once (a sum with no step since)
    and timed nothing; and a sum after the timing must not count the gradients twice."""
    pytest.importorskip("torch")
    from megatron_prt.runtime.local import all_ok, run_local

    for timed, kept in all_ok(run_local(2, _time_after_a_sum)):
        assert timed == 3 and kept
