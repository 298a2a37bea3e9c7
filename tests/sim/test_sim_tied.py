"""The tied embedding sum in the simulator: free without ``tied_grad_bytes``, exact on
hand-checked cases (remote pair, local pair, after the bi replica sum), and paired and sized
as the runtime's exchange (:func:`megatron_prt.runtime.replicas.exchange_pairs` over
:meth:`Placement.end_pairs`, what :func:`megatron_prt.megatron.model.tie_grads` runs)."""

import pytest

from megatron_prt.core import Placement, build_plan
from megatron_prt.sim.cost import CostModel
from megatron_prt.sim.simulate import simulate

PRICED = {"replica_latency": 0.5, "replica_bandwidth": 8.0, "replica_add_bandwidth": 32.0}


def _cost(**fields) -> CostModel:
    return CostModel(fwd_time=2.0, bwd_time=4.0, **{**PRICED, **fields})


def test_a_cross_rank_pair_adds_its_exchange_after_the_later_rank():
    # 1F1B, P = 2, m = 2, forward 1 / backward 2 per stage:
    #   rank 0: 0F0 [0,1]  0F1 [1,2]  0B0 [4,6]  0B1 [7,9]
    #   rank 1: 1F0 [1,2]  1B0 [2,4]  1F1 [4,5]  1B1 [5,7]
    # Stage 0 (rank 0) and stage 1 (rank 1) hold the tied copies; the pair starts at 9, when
    # rank 0 is done (rank 1 waits 2): 0.5 latency + 16 / 8 sent + 16 / 32 added = 3.
    plan = build_plan(Placement(2, 1), 2)
    assert [" ".join(map(str, acts)) for acts in plan.ranks] == [
        "0F0 0F1 0B0 0B1",
        "1F0 1B0 1F1 1B1",
    ]
    result = simulate(plan, _cost(tied_grad_bytes=16.0))
    assert result.timeline.makespan == pytest.approx(9.0)
    assert result.makespan == pytest.approx(12.0)
    assert result.tied_sync_time == pytest.approx(3.0)
    assert [(r.tied_wait, r.tied_sync) for r in result.per_rank] == [(0.0, 3.0), (2.0, 3.0)]
    assert result.bubble_fraction == pytest.approx(1 - 12 / 24)  # the sum is idle time


def test_both_copies_on_one_rank_only_add():
    # wave, even R: stage 0 and stage D-1 both on rank 0; each copy takes the sum in place,
    # 2 x 16 bytes added at 32 per unit, no latency; rank 1 holds neither.
    plan = build_plan(Placement(2, 2, "wave"), 2)
    result = simulate(plan, _cost(tied_grad_bytes=16.0))
    assert result.timeline.makespan == pytest.approx(8.0)
    assert result.makespan == pytest.approx(9.0)
    assert [r.tied_sync for r in result.per_rank] == pytest.approx([1.0, 0.0])


def test_under_bi_it_follows_the_replica_sum_and_sends_both_pipelines_copies():
    # Chimera P = 2, m = 2: both ranks done at 6, the replica sum takes 3 (test_sim_replicas);
    # then pipeline 0's (0, 1) and pipeline 1's (2, 3) pairs both join ranks 0 and 1: each
    # sends 32 bytes, 0.5 + 32 / 8 + 32 / 32 = 5.5.
    plan = build_plan(Placement(2, 1, "loop", "bi"), 2)
    result = simulate(plan, _cost(param_bytes=64.0, tied_grad_bytes=16.0))
    assert result.replica_sync_time == pytest.approx(3.0)
    assert result.tied_sync_time == pytest.approx(5.5)
    assert result.makespan == pytest.approx(6.0 + 3.0 + 5.5)


@pytest.mark.parametrize(
    "placement", [Placement(2, 1), Placement(3, 2, "wave", "bi"), Placement(4, 3, "wave")]
)
def test_free_without_tied_bytes_or_transport_costs(placement):
    plan = build_plan(placement, 4)
    for cost, without in (
        (_cost(tied_grad_bytes=0.0), _cost()),
        (CostModel(2.0, 4.0, tied_grad_bytes=1e9), CostModel(2.0, 4.0)),
    ):
        result = simulate(plan, cost)
        assert result.tied_sync_time == 0.0
        assert result.makespan == simulate(plan, without).makespan
        assert all(r.tied_sync == 0.0 for r in result.per_rank)


def test_a_one_stage_pipeline_has_no_pair():
    assert Placement(1, 1).end_pairs() == ()
    assert Placement(1, 2).end_pairs() == ((0, 1),)
    assert Placement(2, 1, "loop", "bi").end_pairs() == ((0, 1), (2, 3))


def test_cost_json_round_trip_and_old_files():
    cost = _cost(tied_grad_bytes=16.0)
    assert CostModel.from_dict(cost.to_dict()) == cost
    assert "tied_grad_bytes" not in _cost().to_dict()  # older readers still load it
    with pytest.raises(Exception, match="tied_grad_bytes must be >= 0"):
        CostModel(tied_grad_bytes=-1.0)


# -- against the runtime's exchange ---------------------------------------------------------
NUMEL = 4  # float32 elements of the tied weight: 16 bytes


def _exchange(rank, world, placement):
    """Run ``exchange_pairs`` over the end pairs as ``tie_grads`` does; record what this
    rank sends (bytes, peers) and how many bytes it adds."""
    import torch
    import torch.distributed as dist

    from megatron_prt.runtime import replicas

    sent, peers, added = [0], set(), [0]
    real = dist.batch_isend_irecv

    def recording(ops):
        for op in ops:
            if op.op is dist.isend:
                sent[0] += op.tensor.numel() * op.tensor.element_size()
                peers.add(op.peer)
        return real(ops)

    def apply(stage, received, own):
        added[0] += received.numel() * received.element_size()

    dist.batch_isend_irecv = recording
    try:
        replicas.exchange_pairs(
            placement.end_pairs(),
            placement.rank_of,
            None,
            lambda stage: torch.full((NUMEL,), float(stage)),
            apply,
            both_ways=True,
            timeout_s=30,
        )
    finally:
        dist.batch_isend_irecv = real
    return sent[0], peers, added[0]


@pytest.mark.parametrize(
    "placement",
    [
        Placement(2, 1),
        Placement(3, 2, "loop"),
        Placement(3, 2, "wave"),
        Placement(3, 3, "wave"),
        Placement(2, 2, "wave", "bi"),
        Placement(3, 1, "loop", "bi"),
    ],
    ids=str,
)
def test_bytes_and_peers_match_the_runtime(placement):
    pytest.importorskip("torch")
    from megatron_prt.runtime.local import all_ok, run_local
    from megatron_prt.sim.replica_sync import tied_syncs

    cost = CostModel(1.0, 2.0, replica_latency=1.0, tied_grad_bytes=4.0 * NUMEL)
    sums = tied_syncs(placement, cost, [0.0] * placement.ranks)
    got = all_ok(run_local(placement.ranks, _exchange, placement, deadline_s=60))
    for rank, (sent, peers, added) in enumerate(got):
        assert sums[rank].sent_bytes == sent, rank
        assert sums[rank].added_bytes == added, rank
        assert peers == ({sums[rank].peer} if sums[rank].peer is not None else set()), rank
