"""benchmarks/gloo_1f1b.py runs and prints its table (a tiny layer stack, two steps)."""

from megatron_prt.bench.layer_stack.gloo_1f1b import OURS, TORCH, ZB, main


def test_gloo_1f1b_head_to_head_prints_every_row(capsys):
    args = "--microbatches 2 --reps 2 --warmup 1 --hidden 16 --mb-size 2 --zb".split()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| m=2 |" in out
    for key in (OURS, TORCH, ZB):
        assert f"| {key} |" in out
