"""A rank killed in the middle of a checkpoint save of examples/pretrain_bert.py: the other
rank stops with an error naming the folder, the killed rank and the checkpoint that still
loads; ``latest`` keeps naming the previous checkpoint, and a new launch resumes from it and
saves over the partial folder. CPU, gloo, two ranks under torchrun, about a minute."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_pretrain_bert import EXAMPLE, TINY, bi_flags, data_cache, progress  # noqa: F401

from megatron_prt.megatron.bert_checkpoint import checkpoint_dir, is_complete

INJECT = Path(__file__).resolve().parent / "kill_in_save"  # its sitecustomize kills the rank


def run_example(*flags: str, env: dict, log: Path) -> tuple[int, str]:
    """``(exit status, output)`` of the example on two CPU ranks under torchrun. The output
    goes through a file: processes a killed rank leaves behind keep a pipe open."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(EXAMPLE), *TINY, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=300, env=env)
    return done.returncode, log.read_text()


def end_leftovers(pids: Path) -> None:
    """End the processes of the injected launch still running (each left its pid in
    ``pids``; a pid is ended only while its process still names ``pids`` in its environment)."""
    for entry in pids.iterdir():
        with contextlib.suppress(OSError):
            if str(pids).encode() in Path(f"/proc/{entry.name}/environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)


def test_rank_killed_mid_save_keeps_the_previous_checkpoint(data_cache, tmp_path):  # noqa: F811
    pytest.importorskip("megatron.core")
    save = tmp_path / "ckpt"
    flags = bi_flags(data_cache, "--save", str(save), "--save-interval", "2")
    path = os.pathsep.join(filter(None, [str(INJECT), os.environ.get("PYTHONPATH")]))
    pids = tmp_path / "pids"
    pids.mkdir()
    kill = {"PYTHONPATH": path, "PRT_DIE_RANK": "1", "PRT_DIE_IN": "iter_0000004"}
    # an earlier complete save of iteration 4 (resumed from 2): megatron writes over a folder
    # and leaves its metadata, so the half-written one passed for complete
    earlier = checkpoint_dir(str(save), 4)
    earlier.mkdir(parents=True)
    for name in ("metadata.json", ".metadata", "common.pt"):
        (earlier / name).write_bytes(b"from an earlier save")
    assert is_complete(earlier)
    try:
        status, output = run_example(
            *flags, env={**kill, "PRT_PIDS": str(pids)}, log=tmp_path / "killed.log"
        )
    finally:
        end_leftovers(pids)
    assert status != 0, output[-3000:]
    partial = checkpoint_dir(str(save), 4)
    assert partial.is_dir() and not is_complete(partial)  # rank 1 died inside this save
    assert (save / "latest").read_text().strip() == "2"
    assert (
        f"rank 0: saving {partial} failed (rank(s) [1] stopped without reporting an error" in output
    ), output[-3000:]
    assert f"{save}/latest still names iteration 2, which loads" in output

    status, output = run_example(*flags, "--load", str(save), env={}, log=tmp_path / "resumed.log")
    assert status == 0, output[-3000:]
    assert f"resumed from {checkpoint_dir(str(save), 2)}" in output
    assert [int(p[0]) for p in progress(output)] == [3, 4, 5, 6]
    assert (save / "latest").read_text().strip() == "6"
    assert is_complete(partial)  # saved again over the partial folder


def _loads_apart(rank, world, load):
    """What ``_agree`` does when rank 0 read iteration 3 and rank 1 found no ``latest``."""
    import argparse
    import io

    from megatron_prt.megatron import bert_checkpoint

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            bert_checkpoint._agree(argparse.Namespace(load=load), None, 3 if rank == 0 else None)
        except SystemExit as exc:
            return exc.code, err.getvalue()
    return None, err.getvalue()


def test_ranks_reading_different_checkpoints_are_refused_by_name(tmp_path):
    """A --load on storage each node has its own of: rank 0 resumed at iteration 3 while
    rank 1 started fresh, and they went on to different collectives (a hang)."""
    from megatron_prt.runtime.local import all_ok, run_local

    (rank0, said), (rank1, quiet) = all_ok(run_local(2, _loads_apart, str(tmp_path)))
    assert rank0 == rank1 == 2 and not quiet
    assert "iteration 3: rank(s) 0; no latest: rank(s) 1" in said
    assert "every rank reads alike" in said


def test_a_sigterm_swallowed_where_it_landed_comes_again():
    """The launcher's SIGTERM landed in logging's at-fork hook while a checkpoint writer
    forked: the hook ignored the handler's Terminated, and the rank waited on until it was
    killed, without its report (seen once in CI). The signal now comes again until the
    rank reports ([Note: a swallowed SIGTERM])."""
    pytest.importorskip("megatron.core")
    from megatron_prt.megatron.save_signals import RESEND_S, Terminated, terminated_raises

    swallowed = []
    with pytest.raises(Terminated), terminated_raises():
        try:  # as the hook did: the first Terminated goes nowhere
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        except Terminated:
            swallowed.append(True)
        deadline = time.monotonic() + 10 * RESEND_S
        while time.monotonic() < deadline:  # the rank waits on, as after the fork
            time.sleep(0.01)
    assert swallowed


def test_a_process_forked_during_a_save_terminates_plainly():
    """A checkpoint writer's worker forked while the saving rank's SIGTERM handler was
    installed inherited it: the launcher's SIGTERM raised the rank's Terminated inside the
    child's start-up, and the rank, waiting on it, was killed before it reported the save
    (seen once in CI). A child now ends on SIGTERM as by default; the rank keeps its report."""
    pytest.importorskip("megatron.core")
    from megatron_prt.megatron.save_signals import terminated_raises

    with terminated_raises():
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: say whether SIGTERM is the default action, and leave
            os.write(write, b"1" if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 1) == b"1"
        assert getattr(signal.getsignal(signal.SIGTERM), "saving", False)  # the rank's own
