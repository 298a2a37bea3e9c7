"""What the measured benchmark sections share (megatron_prt/bench/common.py): their cost
models take a wire's one-way time less both ends' CPU as the message latency ([Note: a hop's
time less its CPU] in megatron_prt/tune/measured.py), the layer-stack and BERT sections as the
tuned grid does; a bi row's replica sums are those of its timed rounds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_prt.bench import bert
from megatron_prt.bench.common import wire_fields, wire_md
from megatron_prt.bench.layer_stack.ranks import cost_model
from megatron_prt.sim.cost import LayerCost

WIRE = (0.9e-3, 0.3e-3)  # one way, CPU per end
REPLICA = {"latency_s": 1e-3, "wire_s_per_byte": 1e-9, "add_s_per_byte": 1e-10}


def test_wire_fields_take_both_ends_cpu_out():
    assert wire_fields(WIRE) == pytest.approx({"p2p_latency": 0.3e-3, "p2p_cpu": 0.3e-3})
    assert wire_fields((0.061e-3, 0.038e-3))["p2p_latency"] == 0.0  # all CPU: none in flight
    assert wire_md(WIRE) == "one way 0.900 ms, CPU 0.300 ms per end, so 0.300 ms in flight"


def test_layer_stack_cost_model_uses_them():
    cost = cost_model(SimpleNamespace(layers=4), LayerCost(1e-3, 2e-3), WIRE, REPLICA)
    assert (cost.p2p_latency, cost.p2p_cpu) == pytest.approx((0.3e-3, 0.3e-3))


def test_bert_cost_model_uses_them():
    costs = {"layers": [{"fwd": 1e-3, "bwd": 2e-3}] * 2, "message_bytes": 1 << 17}
    cost = bert.cost_model(costs, WIRE, REPLICA)
    assert (cost.p2p_latency, cost.p2p_cpu) == pytest.approx((0.3e-3, 0.3e-3))


class _Runner:
    """A runner whose every step sums replicas in ``value`` seconds."""

    plan, wire, value = None, "shm", 1.0

    def __init__(self) -> None:
        self.replica_sum_s: list[float] = []

    def step(self) -> None:
        self.replica_sum_s.append(self.value)

    def peak_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_replica_sums_are_the_timed_rounds_not_the_checks_steps(monkeypatch):
    """The tuned grid's check (its held-out rematch) steps runners again after the rounds:
    their sums must not stand in for the rounds' (the last rounds' slice took them)."""
    from megatron_prt.bench import common

    monkeypatch.setattr(common, "timed_step", lambda runner, warm: runner.step() or 1.0)
    monkeypatch.setattr(common, "say", lambda message: None)

    def rematch(runners, times):
        for runner in runners.values():
            runner.value = 9.0
            for _ in range(5):
                runner.step()
        return {}

    args = SimpleNamespace(warmup=1, reps=3)
    measured = common.measure_runners({"bi": _Runner()}, args, "test", rematch)
    assert measured["replica_sum_s"] == {"bi": 1.0}
