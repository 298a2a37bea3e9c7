"""torch.distributed.pipelining's schedules read into plans: valid, complete, on torch's own
placement, and timed like ours (torch's 1F1B and our 1F1B agree under equal stages)."""

import re
from collections import Counter

import pytest

pytest.importorskip("torch")

from megatron_prt.bench import peers as bench_peers
from megatron_prt.cli.main import main
from megatron_prt.core.actions import Action, Op
from megatron_prt.core.lower import lower
from megatron_prt.core.placement import Placement
from megatron_prt.core.schedules import build_plan
from megatron_prt.core.validate import validate
from megatron_prt.runtime import peers
from megatron_prt.sim.cost import CostModel
from megatron_prt.sim.simulate import simulate

SPLIT = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
CASES = [(pp, m) for pp in (2, 4) for m in (pp, 2 * pp)]


def _refused_by_torch(peer: peers.Peer, pp: int, m: int) -> bool:
    """The configurations torch 2.13 documents as refused, among :data:`CASES`."""
    return peer.name == "ScheduleDualPipeV" and m < 2 * pp


@pytest.mark.parametrize("peer", peers.PEERS, ids=lambda p: p.name)
@pytest.mark.parametrize(("pp", "m"), CASES)
def test_peer_plan_is_valid_and_runs_every_action_once(peer, pp, m):
    if _refused_by_torch(peer, pp, m):
        with pytest.raises(peers.PeerRefusedError, match=f"torch {peer.name} refuses P={pp}"):
            peers.peer_plan(peer, pp, m)
        return
    plan = peers.peer_plan(peer, pp, m)
    validate(plan)
    validate(lower(plan))
    placement = plan.placement
    ops = (Op.F, Op.I, Op.W) if peer.name in SPLIT else (Op.F, Op.B)
    wanted = {
        Action(s, op, mb) for s in range(placement.num_stages) for op in ops for mb in range(m)
    }
    ran = Counter(a for actions in plan.ranks for a in actions)
    assert set(ran) == wanted
    assert set(ran.values()) == {1}
    for rank, actions in enumerate(plan.ranks):
        assert all(placement.rank_of(a.stage) == rank for a in actions)


@pytest.mark.parametrize(("pp", "m"), [*CASES, (4, 9)])
@pytest.mark.parametrize("cost", [CostModel(), CostModel(p2p_latency=0.1)], ids=["free", "hop"])
def test_torch_1f1b_times_like_our_1f1b(pp, m, cost):
    theirs = peers.peer_plan(peers.PEERS[0], pp, m)
    ours = build_plan(Placement(pp, 1), m, "1f1b")
    assert theirs.placement == ours.placement
    assert simulate(theirs, cost).makespan == simulate(ours, cost).makespan


@pytest.mark.parametrize("name", ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
@pytest.mark.parametrize("pp", [2, 4])
def test_v_schedules_use_wave_placement_with_two_stages_per_rank(name, pp):
    peer = next(p for p in peers.PEERS if p.name == name)
    plan = peers.peer_plan(peer, pp, 2 * pp)
    assert plan.placement == Placement(pp, 2, "wave")
    for rank in range(pp):
        assert plan.placement.rank_stages[rank] == (rank, 2 * pp - 1 - rank)
        assert {a.stage for a in plan.ranks[rank]} == {rank, 2 * pp - 1 - rank}


def test_interleaved_follows_the_reuse_on_loop_placement():
    interleaved = next(p for p in peers.PEERS if p.name == "ScheduleInterleaved1F1B")
    plan = peers.peer_plan(interleaved, 4, 8, reuse=3)
    assert plan.placement == Placement(4, 3, "loop")
    validate(lower(plan))


def test_changed_torch_layout_names_the_torch_version(monkeypatch):
    class Reshaped:
        def __init__(self, stages, n_microbatches, loss_fn=None):
            # an attribute the stand-in stage does not have
            self.virtual = stages[0].num_virtual_stages

    monkeypatch.setattr(peers.torch_schedules, "ScheduleZBVZeroBubble", Reshaped)
    zbv = next(p for p in peers.PEERS if p.name == "ScheduleZBVZeroBubble")
    with pytest.raises(peers.PeerLayoutError, match=re.escape(f"torch {peers.torch.__version__}:")):
        peers.peer_plan(zbv, 2, 4)


def _compare(capsys, *argv):
    assert main(["compare", *argv]) == 0
    return capsys.readouterr().out


def test_compare_lists_the_peer_rows(capsys):
    out = _compare(capsys, "--pp", "4", "-m", "8", "--split-backward")
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    for label in ("torch 1F1B", "torch interleaved R=2", "torch ZB1P R=2", "torch ZBV R=2"):
        assert label in rows and "n/a" not in rows[label]
    assert rows["torch 1F1B"].split()[2:5] == rows["1F1B"].split()[1:4]


def test_compare_shows_split_backward_peers_only_with_split_backward(capsys):
    """Was: torch's zero-bubble orders (W apart) beside whole-backward rows alone, as if
    faster than every schedule of the table."""
    out = _compare(capsys, "--pp", "4", "-m", "8")
    labels = {line.split("  ")[0].strip() for line in out.splitlines()}
    assert {"torch 1F1B", "torch interleaved R=2"} <= labels
    assert not any(label.startswith(("torch ZB", "torch DualPipeV")) for label in labels)
    assert not any(label.startswith("ZB ") for label in labels)


def test_compare_says_na_with_torch_reason(capsys):
    out = _compare(capsys, "--pp", "4", "-m", "9")
    line = next(x for x in out.splitlines() if x.startswith("torch interleaved R=2"))
    assert "n/a" in line and "multiple of the number of rounds" in line
    out = _compare(capsys, "--pp", "4", "-m", "4", "--split-backward")
    line = next(x for x in out.splitlines() if x.startswith("torch DualPipeV R=2"))
    assert "n/a" in line and "at least as many microbatches as stages" in line


def test_compare_without_torch_has_no_peer_rows_but_says_why(capsys, monkeypatch):
    monkeypatch.setattr(bench_peers.importlib.util, "find_spec", lambda name: None)
    out = _compare(capsys, "--pp", "2", "-m", "4")
    torch_rows = [line for line in out.splitlines() if line.startswith("torch")]
    assert torch_rows == [next(x for x in torch_rows if "torch is not installed" in x)]
    assert "1F1B" in out


def test_simulated_peer_rows_time_torch_1f1b_like_ours():
    rows = bench_peers.simulated_peers(8, 8, lambda placement: CostModel())
    assert [r.label for r in rows][:2] == ["torch 1F1B", "torch interleaved R=2"]
    ours = simulate(build_plan(Placement(8, 1), 8, "1f1b"))
    assert rows[0].result.makespan == ours.makespan
    assert len(rows) == len(peers.PEERS)
    dualpipe = next(r for r in rows if r.label == "torch DualPipeV R=2")
    assert dualpipe.result is None and dualpipe.why


def test_torch_split_orders_are_priced_in_the_plain_layers_form():
    """Our split layers' own times (split_fwd / split_bwd, which profile writes) were
    charged to torch's zero-bubble orders, which split plain layers' backward with
    autograd: ZB1P and ZBV came out 11% slower (51.0 -> 56.5 at P=4, m=8)."""
    from dataclasses import replace

    from megatron_prt.sim.cost import LayerCost

    layer = LayerCost(1.0, 2.0, act=1.0, param=1.0, wgrad=1.0)
    plain = CostModel(layers=(layer,) * 8)
    ours = CostModel(layers=(replace(layer, split_fwd=1.12, split_bwd=2.2, wgrad=1.1),) * 8)
    rows = {cost: bench_peers.simulated_peers(4, 8, lambda p, c=cost: c) for cost in (plain, ours)}
    for a, b in zip(rows[plain], rows[ours], strict=True):
        if a.result is not None:
            assert a.result.makespan == pytest.approx(b.result.makespan), a.label
    assert ours.plain_form().layers[0] == layer  # W keeps its share: 1.1 / 2.2 of 2.0
