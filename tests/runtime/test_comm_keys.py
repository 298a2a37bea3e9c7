"""`megatron-prt profile`'s message keys from its measurements (:func:`comm_keys`): with the
message CPU fitted in place, the hop line is what is left of the timed hops once both ends'
CPU is out ([Note: a hop's time less its CPU] in megatron_prt/tune/measured.py). The timed
steps here come from the simulator at a known latency and CPU, so the answer is known."""

from __future__ import annotations

import pytest

from megatron_prt.core import Placement, build_plan
from megatron_prt.runtime.comm_timing import comm_keys, marginal_hop
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate

LAYERS = (LayerCost(1.0, 2.0),) * 8
FEW = build_plan(Placement(2, 1), 2, "1f1b")
MANY = build_plan(Placement(2, 4), 2, "prt")
REPLICA = {"latency_s": 0.5, "wire_s_per_byte": 1e-9, "add_s_per_byte": 0.0}
BYTES = 1 << 20


def _stand_in(in_flight: float, cpu: float) -> tuple:
    truth = CostModel(layers=LAYERS, p2p_latency=in_flight, p2p_cpu=cpu, message_bytes=BYTES)
    return LAYERS, BYTES, [(plan, simulate(plan, truth).makespan) for plan in (FEW, MANY)]


@pytest.mark.parametrize("in_flight, cpu", [(0.05, 0.2), (0.3, 0.05), (0.0, 0.4)])
def test_the_fitted_cpu_comes_out_of_the_hop(in_flight, cpu):
    """A hop timed one way holds both ends' CPU: taken whole as the latency, the fit put
    part of the many-message step's cost in flight and under-read the CPU."""
    one_way = in_flight + 2 * cpu
    hops = [(4096, one_way), (BYTES, one_way)]  # copies that cost nothing in flight
    keys = comm_keys(hops, REPLICA, _stand_in(in_flight, cpu))
    assert keys["p2p_cpu"] == pytest.approx(cpu, rel=1e-3)
    assert keys["p2p_latency"] == pytest.approx(in_flight, abs=1e-3 * cpu)
    assert keys["p2p_bandwidth"] is None


def _priced(keys: dict, size: int) -> float:
    return keys["p2p_latency"] + size / keys["p2p_bandwidth"]


def test_the_line_is_the_hops_less_the_cpu():
    stand_in = _stand_in(0.1, 0.2)
    hops = [(4096, 0.5), (BYTES + 4096, 0.5 + BYTES * 1e-6)]
    keys = comm_keys(hops, REPLICA, stand_in)
    cpu = keys["p2p_cpu"]
    assert keys["p2p_bandwidth"] == pytest.approx(1e6)
    for size, seconds in hops:
        assert _priced(keys, size) == pytest.approx(seconds - 2 * cpu)


def test_without_the_cpu_fit_the_line_prices_both_hops_as_timed():
    """The small hop's time was the latency, so the model's message (the large hop) was
    priced at its time plus the small one's bytes over the bandwidth: 16% over the timed
    hop for a 16 KiB message."""
    hops = [(4096, 0.5), (BYTES + 4096, 0.5 + BYTES * 1e-6)]
    keys = comm_keys(hops, REPLICA, None)
    assert "p2p_cpu" not in keys
    for size, seconds in hops:
        assert _priced(keys, size) == pytest.approx(seconds)
    assert keys["replica_latency"] == 0.5 and keys["replica_add_bandwidth"] is None
    keys = comm_keys([(4096, 1.0), (8192, 5.0)], REPLICA, None)  # the line crosses 0 above
    assert keys["p2p_latency"] == 0.0  # 0 bytes: never below 0


def test_a_hop_is_the_slope_of_step_time_over_hops():
    """[Note: a hop is what one more message costs]: a step's fixed work, paid once, is not
    a message's."""
    assert marginal_hop((1, 0.25), (15, 0.25 + 14 * 0.03)) == pytest.approx(0.03)
    assert marginal_hop((1, 0.25), (15, 0.2)) == 0.0  # noise: never below 0


def test_a_large_hop_timed_faster_than_a_small_one_is_said():
    """The large hop timing under the small one (noise) wrote the bandwidth as free without
    a word."""
    with pytest.warns(UserWarning, match=r"timed faster than one of 4096 bytes.*--reps"):
        keys = comm_keys([(4096, 2e-4), (BYTES, 1.9e-4)], REPLICA, None)
    assert keys["p2p_bandwidth"] is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # slower at more bytes, or sizes too close to tell
        comm_keys([(4096, 2e-4), (BYTES, 3e-4)], REPLICA, None)
        comm_keys([(4096, 2e-4), (8192, 1.9e-4)], REPLICA, None)


def test_a_small_hop_timed_as_free_is_said():
    """The longer chain timing no slower than the shorter one (noise: --reps 1 on a busy
    CI host) wrote p2p_latency 0 without a word."""
    with pytest.warns(UserWarning, match=r"hop of 4096 bytes timed as free.*--reps"):
        keys = comm_keys([(4096, 0.0), (BYTES, 3e-4)], REPLICA, None)
    assert keys["p2p_latency"] == 0.0
