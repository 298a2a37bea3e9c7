import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_prt.core.actions import Action, Op, parse


@given(st.integers(0, 10_000), st.sampled_from(list(Op)), st.integers(0, 10_000))
def test_string_form_round_trips(stage, op, mb):
    action = Action(stage, op, mb)
    assert parse(str(action)) == action


def test_examples():
    assert str(Action(5, Op.F, 2)) == "5F2"
    assert parse("3SEND_B1") == Action(3, Op.SEND_B, 1)
    assert parse("12RECV_F0") == Action(12, Op.RECV_F, 0)
    assert Op.F.is_compute and Op.SEND_F.is_comm


@pytest.mark.parametrize("bad", ["", "F1", "1F", "1X2", "-1F0", "1 F 2", "1SEND2"])
def test_bad_strings_are_refused(bad):
    with pytest.raises(ValueError, match="not an action"):
        parse(bad)
