"""The flat check's replay of a lowered plan walks SEND/RECV pairs only
(megatron_prt.core.flatcheck._pairs_complete, [Note: pairs only]): whenever the row checks
pair every SEND with its RECV, its verdict is the blocking replay's
(megatron_prt.core.rendezvous.stuck_ranks), on valid plans and on plans one or two edits
away, over placements, directions, R, m and split backward."""

import itertools
import random
from dataclasses import replace

import pytest
from plan_mutations import mutations

from megatron_prt.core import Placement, build_plan
from megatron_prt.core.flatcheck import _Flat, _pairs_complete
from megatron_prt.core.lower import lower
from megatron_prt.core.rendezvous import stuck_ranks


def _pairs_verdict(plan):
    """The pair replay's verdict, or None when the row checks refuse ``plan`` first."""
    try:
        flat = _Flat.of(plan)
    except (IndexError, KeyError, TypeError):
        return None
    if flat is None or not flat.local_order_holds():
        return None
    pairs = flat.message_pairs()
    return None if pairs is None else _pairs_complete(*pairs)


CASES = [
    (Placement(p, r, placement, direction), m, schedule)
    for (p, r, m), placement, direction, schedule in itertools.product(
        [(2, 1, 4), (3, 2, 6), (4, 2, 8)],
        ["loop", "wave"],
        ["uni", "bi"],
        ["prt", "zb"],
    )
]


@pytest.mark.parametrize("placement, m, schedule", CASES, ids=str)
def test_pair_replay_agrees_with_the_blocking_replay(placement, m, schedule):
    lowered = replace(lower(build_plan(placement, m, schedule)))
    assert _pairs_verdict(lowered) is True
    rng = random.Random(f"pairs{placement}{m}{schedule}")
    verdicts = []
    for once in mutations(lowered, rng, 60):
        for bad in [once, *mutations(once, rng, 2)]:
            verdict = _pairs_verdict(bad)
            if verdict is not None:
                assert verdict == (not stuck_ranks(bad)), bad
                verdicts.append(verdict)
    assert False in verdicts  # some edits deadlock the pairs and are caught here


def _replay(streams):
    """Ranks of SEND/RECV names ('s3' sends message 3, 'r3' receives it; '.' computes)."""
    pairs = [[0 if name == "." else 1 + int(name[1:]) for name in stream] for stream in streams]
    for rank, pair in enumerate(pairs):  # a spare entry last, never walked: a lone number
        pair.append(100 + rank)
    return _pairs_complete(pairs, 100 + len(pairs))


def test_pairs_complete_when_one_side_waits():
    assert _replay([["s0", ".", "r1"], [".", "r0", "s1", "."]])
    assert _replay([[".", "s0", "s1"], ["r0", "."], ["r1"]])
    assert _replay([["s0", "."], ["s1", "."], ["r1", "r0"]])  # rank 2 takes 1 first


def test_two_ranks_sending_first_to_each_other_deadlock():
    assert not _replay([["s0", "r1"], ["s1", "r0"]])
    assert not _replay([["s0", "r1", "."], ["s1", ".", "r0"]])


def test_a_cycle_through_three_ranks_deadlocks():
    assert not _replay([["r2", "s0"], ["r0", "s1"], ["r1", "s2"]])
    assert _replay([["s0", "r2"], ["r0", "s1"], ["r1", "s2"]])
