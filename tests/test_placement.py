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


@given(
    st.integers(1, 9),
    st.integers(1, 7),
    st.sampled_from(["loop", "wave"]),
    st.sampled_from(["uni", "bi"]),
)
def test_every_rank_holds_r_chunks_per_pipeline(p, r, placement, direction):
    pl = Placement(p, r, placement, direction)
    for rank, stages in enumerate(pl.rank_stages):
        assert len(stages) == r * pl.num_pipelines
        assert [pl.stage_to_chunk[s] for s in stages] == list(range(r * pl.num_pipelines))
        assert all(pl.rank_of(s) == rank for s in stages)
    if placement == "wave":  # every turn is a same-rank hand-off
        for stage in range(pl.num_stages):
            nxt = pl.next_stage(stage)
            if nxt is not None and nxt % p == 0:
                assert pl.rank_of(nxt) == pl.rank_of(stage)


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
