"""The CPU harness for Megatron-LM's training scripts and the smoke run's log check.

Megatron-LM itself is not installed in CI: ``scripts/megatron_lm_smoke.sh`` runs the harness
on a checkout (docs/gpu.md has its output). Here: the harness's refusal in a CUDA process and
its usage errors, and the log check the smoke run relies on, on logs in Megatron-LM's format.
"""

from __future__ import annotations

import pytest

from megatron_prt.megatron import megatron_lm_check

pytest.importorskip("torch")


def test_harness_refuses_a_process_with_cuda_initialised(monkeypatch):
    import torch

    from megatron_prt.megatron import megatron_lm_cpu

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is initialised in this process"):
        megatron_lm_cpu.enable()


@pytest.mark.parametrize(
    "argv,message",
    [([], "usage:"), (["pretrain_bert.py", "--num-layers", "4"], "needs --spec local")],
)
def test_harness_usage_errors(argv, message):
    from megatron_prt.megatron import megatron_lm_cpu

    with pytest.raises(SystemExit, match=message):
        megatron_lm_cpu.main(argv)


def _log(path, losses: dict[int, float], total: int = 6, sop: bool = False) -> str:
    lines = ["> building train, validation, and test datasets ...\n"]
    for it, loss in losses.items():
        extra = f" sop loss: {0.69:.6E} |" if sop else ""
        lines.append(
            f" [2026-12-01 12:18:51.199345] iteration {it:8d}/{total:8d} | consumed samples: "
            f"{8 * it:12d} | learning rate: 1.000000E-03 | global batch size:     8 | "
            f"lm loss: {loss:.6E} |{extra} loss scale: 1.0 | grad norm: 1.888 |\n"
        )
    path.write_text("".join(lines))
    return str(path)


# Losses of a real 6-iteration run; Megatron-LM prints the second iteration of a run as the
# mean of its first two (megatron_lm_check's docstring).
FIRST = {1: 5.554276, 2: 5.471837, 3: 5.294685, 4: 5.113545, 5: 5.037333, 6: 4.966247}
RESUMED = {4: 5.113545, 5: 5.075439, 6: 4.966247}


def test_check_accepts_a_resumed_run_that_continues_the_losses(tmp_path):
    first = _log(tmp_path / "a.log", FIRST, sop=True)
    resumed = _log(tmp_path / "b.log", RESUMED, sop=True)
    assert megatron_lm_check.read_losses(first)[3] == {"lm loss": 5.294685, "sop loss": 0.69}
    assert megatron_lm_check.check(first, resumed, resumed_at=3) == []
    assert megatron_lm_check.main([first, resumed, "--resumed-at", "3"]) == 0


@pytest.mark.parametrize(
    "resumed,named",
    [
        ({**RESUMED, 6: 4.966248}, "iteration 6 lm loss 4.966248"),
        ({**RESUMED, 4: 5.163918}, "iteration 4 lm loss 5.163918"),
        ({**RESUMED, 5: 5.037333}, "iteration 5 lm loss"),  # printed unaveraged: not Megatron
        ({4: 5.113545, 5: 5.075439}, "iterations [4, 5], expected [4, 5, 6]"),
    ],
)
def test_check_names_the_iteration_a_resumed_run_departs_at(tmp_path, resumed, named):
    first = _log(tmp_path / "a.log", FIRST)
    failures = megatron_lm_check.check(first, _log(tmp_path / "b.log", resumed), resumed_at=3)
    assert failures and named in failures[0], failures


def test_check_refuses_losses_that_do_not_fall(tmp_path):
    flat = {it: 5.5 for it in FIRST}
    failures = megatron_lm_check.check(
        _log(tmp_path / "a.log", flat), _log(tmp_path / "b.log", {4: 5.5, 5: 5.5, 6: 5.5}), 3
    )
    assert failures == [f"{tmp_path / 'a.log'}: lm loss did not fall: 5.5 at iteration 1, "
                        "5.5 at iteration 6"]  # fmt: skip


_SCRIPT = """
import multiprocessing
if __name__ != "__main__":  # as pretrain_bert.py's TE spec import without the harness
    raise ImportError("the script was re-run in a spawned process")
if __name__ == "__main__":
    queue = multiprocessing.get_context("spawn").Manager().Queue()  # as torch_dist's writer
    queue.put("ok")
    print("manager:", queue.get())
"""


@pytest.mark.parametrize("harness", [True, False])
def test_spawned_processes_set_up_without_re_running_the_script(tmp_path, harness):
    """torch_dist's writer starts a manager process with ``spawn``, which re-runs the main
    module: under the harness that is the script, whose imports need the harness. With the
    harness the manager imports the harness instead and the save goes on."""
    import os
    import subprocess
    import sys

    script = tmp_path / "pretrain_x.py"
    script.write_text(_SCRIPT)
    setup = "from megatron_prt.megatron import megatron_lm_cpu as h; "
    setup += "h._spawned_processes_import_the_harness(); " if harness else ""
    command = setup + f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, "-c", command], capture_output=True, text=True, timeout=240, env=env
    )
    if harness:
        assert done.returncode == 0 and "manager: ok" in done.stdout, done.stderr[-2000:]
    else:
        assert done.returncode != 0 and "re-run in a spawned process" in done.stderr
