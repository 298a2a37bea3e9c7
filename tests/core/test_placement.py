import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_prt.core.placement import ConfigError, Placement


def test_loop_and_wave_examples():
    loop = Placement(4, 2, "loop")
    assert loop.stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    wave = Placement(4, 3, "wave")
    assert wave.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3)
    assert wave.stage_to_chunk == (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2)


def test_bi_mirrors_pipeline_zero():
    bi = Placement(4, 2, "wave", "bi")
    assert bi.num_stages == 16 and bi.pipelines[1] == tuple(range(8, 16))
    for j in range(8):
        r0, c0 = bi.locate(j)
        r1, c1 = bi.locate(8 + j)
        assert r1 == 3 - r0 and c1 == c0 + 2
        assert bi.model_stage(8 + j) == j
    pairs = bi.replica_pairs()  # each model stage with its replica, on the mirrored rank
    assert [a for a, _ in pairs] == list(range(8))
    assert all(bi.model_stage(b) == a and bi.rank_of(b) == 3 - bi.rank_of(a) for a, b in pairs)
    assert Placement(4, 2, "wave").replica_pairs() == ()


KNOBS = (
    st.integers(1, 9),
    st.integers(1, 7),
    st.sampled_from(["loop", "wave"]),
    st.sampled_from(["uni", "bi"]),
)


def pipeline0_rank(stage, p, placement):
    """The placement rule written out: pass ``stage // P``, odd wave passes run backwards."""
    pass_, pos = divmod(stage, p)
    return p - 1 - pos if placement == "wave" and pass_ % 2 else pos


@given(st.integers(1, 9), st.integers(1, 7))
def test_loop_puts_stage_s_on_rank_s_mod_p(p, r):
    pl = Placement(p, r, "loop")
    assert [pl.rank_of(s) for s in range(p * r)] == [s % p for s in range(p * r)]
    assert [pl.stage_to_chunk[s] for s in range(p * r)] == [s // p for s in range(p * r)]
    assert pl.rank_stages == tuple(tuple(range(rank, p * r, p)) for rank in range(p))


@given(st.integers(1, 9), st.integers(1, 7))
def test_wave_hands_off_locally_at_turns_and_to_a_neighbour_inside_a_pass(p, r):
    pl = Placement(p, r, "wave")
    assert pl.rank_of(0) == 0
    for stage in range(p * r - 1):
        if (stage + 1) % p == 0:  # a turn: the last stage of a pass feeds the next pass
            assert pl.rank_of(stage + 1) == pl.rank_of(stage)
        else:
            assert abs(pl.rank_of(stage + 1) - pl.rank_of(stage)) == 1
    for rank in range(p):  # pass k: rank r in even passes, rank P-1-r in odd ones
        expected = tuple(k * p + (rank if k % 2 == 0 else p - 1 - rank) for k in range(r))
        assert pl.rank_stages[rank] == expected


@given(*KNOBS)
def test_bi_mirrors_every_stage_onto_rank_p_minus_1_minus_r(p, r, placement, direction):
    pl = Placement(p, r, placement, direction)
    d = p * r
    if direction == "uni":
        assert pl.num_stages == d and pl.replica_pairs() == ()
        return
    assert pl.num_stages == 2 * d
    for j in range(d):
        assert pl.rank_of(d + j) == p - 1 - pipeline0_rank(j, p, placement)
        assert pl.stage_to_chunk[d + j] == j // p + r  # the replica pipeline's chunks follow
        assert pl.model_stage(d + j) == j and pl.pipeline_of(d + j) == 1


@given(*KNOBS)
def test_every_stage_exactly_once_and_r_chunks_per_pipeline_on_every_rank(
    p, r, placement, direction
):
    pl = Placement(p, r, placement, direction)
    pipelines = 2 if direction == "bi" else 1
    listed = sorted(s for stages in pl.rank_stages for s in stages)
    assert listed == list(range(p * r * pipelines))  # every stage, each on one rank
    assert len(pl.rank_stages) == p
    for rank, stages in enumerate(pl.rank_stages):
        assert len(stages) == r * pipelines == pl.chunks_per_rank
        assert [pl.stage_to_chunk[s] for s in stages] == list(range(r * pipelines))
        for s in stages:  # against the rule written out, not against rank_of
            mirrored = s >= p * r
            base = pipeline0_rank(s % (p * r), p, placement)
            assert rank == (p - 1 - base if mirrored else base)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ranks": 0}, "ranks must be"),
        ({"ranks": 2, "reuse": 0}, "reuse must be"),
        ({"ranks": 2, "placement": "zigzag"}, "placement must be one of loop, wave"),
        ({"ranks": 2, "direction": "tri"}, "direction must be one of uni, bi"),
    ],
)
def test_bad_knobs_name_the_knob(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Placement(**kwargs)
