"""Run a function on N gloo ranks on this machine (forked processes, one thread each), or
on N GPUs over NCCL.

Used by the tests and benchmarks, and handy for trying a plan on a laptop:
``run_local(2, fn, arg)`` calls ``fn(rank, world, arg)`` in every rank after
``init_process_group("gloo")`` and returns what each rank returned (or its error).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta


def _entry(fn, rank, world, store, queue, args, backend="gloo"):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, as torchrun's LOCAL_RANK
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        # every rank connected before any goes on: one that finished fn and exited at once
        # closed its sockets while a slower peer still built gloo's mesh, which then failed
        # ("connectFullMesh failed ... Connection closed by peer")
        dist.barrier()
        # Plain pickle copies tensors into the message; the queue's own pickler would share
        # their storage by file descriptor, which dies with this process at os._exit below.
        result = pickle.dumps(fn(rank, world, *args))
        queue.put((rank, "ok", result))
    except BaseException as exc:
        from .errors import PipelineError, finalize_failure, post_failure

        if isinstance(exc, PipelineError):  # the runtime posted its own errors already
            finalize_failure()
        else:
            post_failure(f"rank {rank}: {type(exc).__name__}: {exc}", root=True, final=True)
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        queue.close()
        queue.join_thread()
        _end_children()
        os._exit(0)  # skip teardown: a dead peer must not hang this rank's exit


def _end_children() -> None:
    """Stop the processes this rank started through multiprocessing (megatron's checkpoint
    writer starts a Manager server): os._exit skips the finalizers that would, and each was
    left behind, some 270 MB apiece, for as long as the machine ran."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=5)


def run_local(
    world: int,
    fn,
    *args,
    deadline_s: float = 300.0,
    wait_for=None,
    backend: str = "gloo",
    spawn: bool = False,
) -> list[tuple[str, object]]:
    """Returns ``[(status, result_or_error_text)]`` per rank. Ranks still running once the
    ranks in ``wait_for`` (default all) have reported, or after ``deadline_s``, are killed
    and reported as ``("killed", None)``. ``backend="nccl"``: rank r on GPU r, started
    afresh (``spawn``, always for NCCL: a forked child cannot use CUDA once the parent has;
    ``fn`` and ``args`` must then pickle)."""
    wait_for = set(range(world)) if wait_for is None else set(wait_for)
    ctx = mp.get_context("spawn" if spawn or backend == "nccl" else "fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry, args=(fn, r, world, store, queue, args, backend), daemon=True
            )
            for r in range(world)
        ]
        # A forked child inherits the parent's uncollected garbage and collects it there, in
        # the middle of its timed steps: the profiler's split-capable model (then a
        # reference cycle: [Note: split-capable by class] in wgrad.py) stalled `megatron-prt
        # profile --recompute-granularity selective`'s comm timing until its 300 s deadline,
        # one child collecting while its peer spun. Any garbage a caller left in cycles
        # would do the same: the parent collects first.
        gc.collect()
        for p in procs:
            p.start()
        results: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + deadline_s  # for the whole run, not each report
        try:
            while not wait_for <= set(results):
                left = max(deadline - time.monotonic(), 0.001)
                rank, status, payload = queue.get(timeout=left)
                results[rank] = (status, pickle.loads(payload) if status == "ok" else payload)
        except Exception:
            pass
        for rank, p in enumerate(procs):
            p.join(timeout=30 if rank in results else 0)  # ending its children takes time
            if p.is_alive():
                p.kill()
                p.join()
    return [results.get(r, ("killed", None)) for r in range(world)]


def all_ok(results) -> list:
    """The per-rank results, or a RuntimeError listing every rank that failed."""
    errors = [
        f"rank {r}: " + ("killed: it did not finish by the deadline" if s == "killed" else payload)
        for r, (s, payload) in enumerate(results)
        if s != "ok"
    ]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [payload for _, payload in results]
