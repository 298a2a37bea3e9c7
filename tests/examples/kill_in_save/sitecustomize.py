"""Fault injection for tests/examples/test_checkpoint_faults.py, imported at start-up by
every Python process whose path holds this folder: the rank ``$PRT_DIE_RANK`` is killed
(SIGKILL, as by the OOM killer or a preempted node) once its checkpoint writer has put part
of its shard of the folder named ``$PRT_DIE_IN`` on disk. Each process also leaves its pid in
``$PRT_PIDS``: a killed rank's helper processes (dist_checkpointing's multiprocessing
manager, the resource tracker) outlive it."""

import os

if os.environ.get("PRT_PIDS"):  # the test ends the killed rank's orphans by these ids
    with open(os.path.join(os.environ["PRT_PIDS"], str(os.getpid())), "w"):
        pass

if os.environ.get("PRT_DIE_IN") and os.environ.get("RANK") == os.environ.get("PRT_DIE_RANK"):
    import functools
    import signal

    import torch.distributed.checkpoint.filesystem as filesystem

    _rank_pid, _write_item = os.getpid(), filesystem._write_item

    @functools.wraps(_write_item)  # the signature megatron's writer inspects
    def _dying_write_item(*args, **kwargs):
        stream = next(a for a in args if hasattr(a, "fileno") and hasattr(a, "name"))
        if os.environ["PRT_DIE_IN"] in str(stream.name):
            stream.write(b"\0" * 4096)  # part of the shard is on disk
            stream.flush()
            os.kill(_rank_pid, signal.SIGKILL)  # the rank; its writer process goes too
            os._exit(9)
        return _write_item(*args, **kwargs)

    filesystem._write_item = _dying_write_item
