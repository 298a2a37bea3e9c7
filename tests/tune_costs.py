"""A per-layer cost file for the tuner tests: uneven layers, so partitions and plans differ."""

from __future__ import annotations

import json

NUM_LAYERS = 12  # the parity models' layer count (tests/parity_models.py)


def cost_dict(num_layers: int = NUM_LAYERS) -> dict:
    """Later layers are slower and hold more; the head is heavy; messages cost time."""
    layers = [
        {"fwd": 1.0 + 0.25 * i, "bwd": 2.0 + 0.5 * i, "act": 1e6 * (1 + i % 3), "param": 4e6}
        for i in range(num_layers)
    ]
    return {
        "layers": layers,
        "embedding": {"fwd": 0.5, "bwd": 0.5, "act": 1e5, "param": 2e7},
        "head": {"fwd": 3.0, "bwd": 4.0, "act": 4e6, "param": 2e7},
        "p2p_latency": 0.05,
        "message_bytes": 1e5,
        "p2p_bandwidth": 1e7,
    }


def write_costs(tmp_path, num_layers: int = NUM_LAYERS) -> str:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(cost_dict(num_layers)))
    return str(path)


def assert_ranked(candidates) -> None:
    """The tuner's order, checked from its rule rather than by ranking again: no candidate
    comes after one slower by more than TIME_TIE, and of two at the very same time the one
    with the smaller rest of the key (peak memory, messages, enumeration order) comes first."""
    from megatron_prt.tune.search_plans import TIME_TIE

    for i, earlier in enumerate(candidates):
        for later in candidates[i + 1 :]:
            assert earlier.makespan <= later.makespan * (1 + TIME_TIE), (earlier, later)
            if earlier.makespan == later.makespan:
                assert earlier.key[1:] <= later.key[1:], (earlier, later)
