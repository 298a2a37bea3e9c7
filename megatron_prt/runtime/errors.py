"""Runtime errors that say where the pipeline stopped, and why on every rank.

A rank that fails posts its error to the job's rendezvous store (the failure board) before
raising. A rank whose wait on a peer then fails (a timeout, a connection reset by a peer
that exited) reads the board and names the rank that failed first and its message, so with
any number of ranks every rank reports the root cause, not only the dead rank's neighbours.
A rank that stops without posting (killed, out of memory) is named as silent.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.actions import Action, Op
from ..core.deps import carries_tensor, producers
from ..core.grid import format_grid
from ..core.lower import comm_key
from ..core.plan import Plan
from .messages import SAME_STEPS, step_said

_BOARD = "megatron_prt/failure/"
_WAIT_WORDS = ("timeout", "timed out", "closed", "reset", "connection", "broken pipe")
REPORT_WAIT_S = 2.0  # how long a rank whose wait failed looks for its peers' reports


class PipelineError(RuntimeError):
    """A rank could not complete its plan: names rank, step, action, the peer involved and
    shows that rank's plan grid around the step."""


def is_wait_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed wait on a peer (timeout, connection lost) rather than an
    error of this rank's own."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, TimeoutError) or any(w in text for w in _WAIT_WORDS)


def rank_label(rank: int, group=None) -> str:
    """How messages name ``rank`` of the pipeline ``group``: ``rank r``, and where the group
    is not the whole world (data parallelism: every pipeline has a rank r) also its global
    rank, ``rank r (global rank g)``."""
    if _part_of_world(group):
        return f"rank {rank} (global rank {dist.get_global_rank(group, rank)})"
    return f"rank {rank}"


def _part_of_world(group) -> bool:
    """Whether ``group`` is a process group smaller than the world (False when unsure)."""
    if group is None or not dist.is_initialized():
        return False
    with contextlib.suppress(Exception):
        return dist.get_world_size(group) != dist.get_world_size()
    return False


def pipeline_error(
    plan, rank: int, step: int, action: Action | None, why: str, who: str | None = None
) -> PipelineError:
    """The error of ``rank`` (named ``who``, by default ``rank r``) at lowered ``step``;
    also posted to the failure board, as a root cause unless the exception being handled is
    a failed wait on a peer."""
    where = f"{who or f'rank {rank}'}, step {step}"
    if action is not None:
        where += f": {action} (stage {action.stage}, mb {action.mb})"
    handling = sys.exc_info()[1]
    post_failure(f"{where}: {why}", root=handling is None or not is_wait_failure(handling))
    return PipelineError(f"{where}: {why}\n{format_grid(plan.ranks, {rank: step})}")


# -- the failure board -----------------------------------------------------------------------
# [Note: reports of an earlier runtime] A caller may catch a runtime's error and build the
# next runtime; a peer can post its error of the earlier runtime after this rank's next
# check began (both raised at once, in either order), so a time stamp cannot tell the two
# runtimes' reports apart. Every rank starts its runtimes in the same order (each start is
# a collective check), so a count of them, the generation, can: a report carries the
# generation it was posted in, and a rank reads only reports of its own generation. A
# process that is ending posts a final report instead (the generation "*"): it cannot be
# caught, and a peer that already started its next runtime must still read it (a rank that
# fails before its next plan check is one generation behind its waiting peers).
_generation = [0]
_ANY = "*"  # a final report's generation: read in every generation


def start_generation() -> None:
    """A new runtime starts on this rank: reports posted before are not its own."""
    _generation[0] += 1
    clear_failure()


def _store():
    """The default process group's rendezvous store, or None without one. torch (to 2.13)
    has no public accessor for it, and a store of our own from public parts (a TCPStore
    client of MASTER_ADDR:MASTER_PORT) would cover env:// start-up only, not file:// or
    tcp:// (local runs, user launchers): this private call is the only one in the package,
    so a torch change can only cost the cross-rank reports, never a run."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


def post_failure(text: str, root: bool, final: bool = False) -> None:
    """Publish this process's error for the other ranks (``root``: its own fault, not a
    failed wait on a peer; ``final``: the process ends with it, so every generation reads
    it: [Note: reports of an earlier runtime]). Never raises: reporting must not hide the
    error itself."""
    store = _store()
    if store is None:
        return
    with contextlib.suppress(Exception):
        first = text.splitlines()[0] if text else ""
        generation = _ANY if final else _generation[0]
        value = f"{'R' if root else 'P'}{time.time():.6f} {generation} {first}"
        store.set(f"{_BOARD}{dist.get_rank()}", value)


def finalize_failure() -> None:
    """The process ends with the error it posted last: make that report final."""
    store = _store()
    if store is None:
        return
    with contextlib.suppress(Exception):
        key = f"{_BOARD}{dist.get_rank()}"
        if store.check([key]):
            head, _, text = store.get(key).decode().split(" ", 2)
            store.set(key, f"{head} {_ANY} {text}")


def clear_failure() -> None:
    """Forget this process's earlier report (a new runtime starts clean)."""
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.delete_key(f"{_BOARD}{dist.get_rank()}")


def _reports(group) -> dict[int, tuple[bool, float, str]]:
    """Posted errors of ``group``'s ranks in this generation ([Note: reports of an earlier
    runtime]): group rank -> (root, time, first line)."""
    store = _store()
    if store is None:
        return {}
    found = {}
    with contextlib.suppress(Exception):
        for rank, global_rank in enumerate(dist.get_process_group_ranks(group or dist.group.WORLD)):
            key = f"{_BOARD}{global_rank}"
            if store.check([key]):
                value = store.get(key).decode()
                stamp, generation, text = value[1:].split(" ", 2)
                if generation in (_ANY, str(_generation[0])):
                    found[rank] = (value[0] == "R", float(stamp), text)
    return found


def peer_failed(group) -> bool:
    """Whether another rank of ``group`` posted a root-cause report in this generation (one
    of an earlier runtime, caught by its caller, is not this one's)."""
    me = dist.get_rank(group)
    return any(root for rank, (root, _, _) in _reports(group).items() if rank != me)


def root_cause(
    group, wait_s: float = REPORT_WAIT_S, name_silent: bool = True, said: str = "rank"
) -> str:
    """What the other ranks of ``group`` reported: the first root-cause report (waiting up
    to ``wait_s`` for one to appear), else (``name_silent``) the ranks that stopped without
    a word; empty if neither. ``said``: how a rank of the default group (``group`` None) is
    called (``global rank`` where the caller's pipeline is a part of it)."""
    me = dist.get_rank(group)
    deadline = time.monotonic() + wait_s
    while True:
        reports = {r: v for r, v in _reports(group).items() if r != me}
        roots = sorted((stamp, r, text) for r, (root, stamp, text) in reports.items() if root)
        if roots:
            _, rank, text = roots[0]
            name = rank_label(rank, group) if group is not None else f"{said} {rank}"
            return f"{name} failed first: {text}"
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    silent = [r for r in range(dist.get_world_size(group)) if r != me and r not in reports]
    if silent and name_silent:
        return (
            f"rank(s) {silent} stopped without reporting an error (killed, out of memory, or "
            "stuck): see their logs"
        )
    return ""


@contextlib.contextmanager
def collective(what: str, group):
    """Around a collective of the runtime (plan check, transport set-up, replica sums): a
    failed wait becomes a :class:`PipelineError` naming this rank, the collective and the
    root cause reported by the other ranks."""
    try:
        yield
    except PipelineError:
        raise
    except Exception as exc:
        rank = dist.get_rank(group)
        detail = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        head = f"{rank_label(rank, group)}: {what} failed"
        post_failure(f"{head}: {detail}", root=not is_wait_failure(exc))
        cause = root_cause(group) if is_wait_failure(exc) else ""
        text = f"{head}: {cause}\n  this rank saw: {detail}" if cause else f"{head}: {detail}"
        raise PipelineError(text) from exc


# -- argument checks -------------------------------------------------------------------------
def check_batch(who: str, name: str, data, ends: list[int], m: int) -> None:
    """``data`` (``inputs`` or ``targets`` of step) holds one tensor per micro-batch where
    this rank reads it: at the stages in ``ends`` (first stages for inputs, last for
    targets); elsewhere it may be None. A refusal is posted for the other ranks, which are
    by then waiting for this one."""
    problem = _batch_problem(who, name, data, ends, m)
    if problem is not None:
        post_failure(str(problem), root=True)
        raise problem


def _batch_problem(who: str, name: str, data, ends: list[int], m: int) -> Exception | None:
    if data is None:
        if ends:
            return ValueError(
                f"{who}: {name}=None, but this rank holds stage(s) {ends} which read "
                f"{name}; pass a list of {m} tensors, one per micro-batch"
            )
        return None
    if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
        return TypeError(f"{who}: {name} is a {type(data).__name__}; pass a list of {m} tensors")
    if len(data) != m:
        return ValueError(f"{who}: {len(data)} {name} for {m} micro-batches")
    for mb in range(m) if ends else ():
        if not isinstance(data[mb], torch.Tensor):
            return TypeError(
                f"{who}: {name}[{mb}] is a {type(data[mb]).__name__}, not a tensor "
                f"(stage {ends[0]}, mb {mb}): each micro-batch's {name[:-1]} must be one "
                "tensor; pack several into one, or unpack them inside the stage module"
            )
    return None


def digest(text: str) -> int:
    """A 60-bit hash of ``text`` (fits an int64 tensor for all_gather)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


_SETTINGS = (
    False,
    True,
    *(getattr(torch, n) for n in ("float32", "float64", "float16", "bfloat16")),
    None,
    "auto",
    "torch",
    "shm",
)


def setting_code(value) -> int:
    """An int64 for a runtime setting (a dtype, a flag) that :func:`setting_text` reads
    back; a digest for any other value."""
    for code, known in enumerate(_SETTINGS):
        if type(value) is type(known) and value == known:
            return code
    return digest(repr(value))


def setting_text(code: int) -> str:
    return repr(_SETTINGS[code]) if code < len(_SETTINGS) else f"a value hashing to {code:016x}"


def refuse_disagreement(
    who: str, name: str, values: list[int], show=str, fix: str | None = None
) -> None:
    """Raise on every rank unless all ranks gathered the same ``values`` of ``name``
    (``show`` writes a value for the message; ``who`` names this rank: :func:`rank_label`;
    ``fix``: what to do, by default what the plan or the setting ``name`` asks)."""
    if len(set(values)) == 1:
        return
    holders: dict[int, list[int]] = {}
    for r, value in enumerate(values):
        holders.setdefault(value, []).append(r)
    what = "; ".join(f"ranks {r} hold {name} {show(v)}" for v, r in holders.items())
    if fix is None:
        fix = (
            "every rank must build the same plan (same P, R, placement, direction, "
            "micro-batches, schedule, split_backward)"
            if name == "plan"
            else f"pass the same {name}= on every rank"
        )
    raise PipelineError(f"{who}: ranks disagree on the {name} ({what}); {fix}")


# what a stage's error says -> why, and the fix, appended to it
KNOWN_FIXES = {
    "a leaf Variable that requires grad is being used in an in-place operation": (
        "the stage changes its input in place (e.g. ReLU(inplace=True) first); a stage gets "
        "its input as a leaf tensor that requires grad, so make that operation out of place"
    ),
}


def with_fix(text: str) -> str:
    """``text``, an error a stage raised, with the fix of :data:`KNOWN_FIXES` it matches."""
    fixes = [fix for said, fix in KNOWN_FIXES.items() if said in text]
    return ": ".join([text, *fixes])


def why_failed(exc: Exception, action: Action | None, plan: Plan, group=None) -> str:
    """The reason for the error text of ``action`` (of ``plan``, on the pipeline ``group``);
    a failed wait on a peer names the root cause the other ranks posted, else the rank
    waited on."""
    text = f"{type(exc).__name__}: {exc}".strip()
    if isinstance(exc, StopIteration) and action is not None:  # its text is empty
        return (
            f"StopIteration: the data ran out at micro-batch {action.mb} (stage {action.stage}): "
            f"give {plan.num_microbatches} per call (megatron: each chunk's data_iterator)"
        )
    if not is_wait_failure(exc):
        return with_fix(text)
    said = "global rank" if _part_of_world(group) else "rank"
    cause = root_cause(None, name_silent=False, said=said)
    if cause:
        return f"{cause}\n  this rank saw: {text}"
    if action is None:
        return text
    placement = plan.placement
    peer = None
    if action.op.is_compute:  # the rank of the action's tensor input, if any
        fed = producers(action, placement, plan.split_backward)
        peer = next((placement.rank_of(p.stage) for p in fed if carries_tensor(p, action)), None)
    else:
        _, src, dst, _ = comm_key(action, placement, plan.split_backward)
        peer = placement.rank_of(dst if action.op in (Op.SEND_F, Op.SEND_B) else src)
    if peer is not None:
        text += (
            f" (waiting on {rank_label(peer, group)}: it may have failed or be stuck, or run "
            "another step: every rank calls step() alike, with the same forward_only)"
        )
    return text


def check_same_step(stamp: int, group, device, who: str, timeout_s: float) -> None:
    """[Note: every message carries its step] where the backend ignores tags: every rank's
    step stamp, gathered over the pipeline ``group``; a :class:`PipelineError` on every
    rank, naming the ranks and their steps, when they differ, or naming the ranks that did
    not arrive within ``timeout_s`` (a collective, not the store: it runs every step)."""
    mine = torch.tensor([stamp], dtype=torch.int64, device=device)
    stamps = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    with collective("the step check", group):
        work = dist.all_gather(stamps, mine, group=group, async_op=True)
        # bounded on NCCL too: the host reads the stamps right after, so waiting there
        # costs nothing (unbounded it waited the process group's timeout on a stuck peer)
        work.wait(timedelta(seconds=timeout_s))
    said = lambda stamp: step_said(stamp).removeprefix("step ")  # noqa: E731
    refuse_disagreement(who, "step", [int(t) for t in stamps], said, SAME_STEPS)


def refuse_after_failure(failed: str | None, who: str, call: str) -> None:
    """Refuse ``call`` of a runtime one of whose steps failed (``failed`` says how; None:
    none did): that step may have left messages unread or read the peers' next ones, so no
    later call could trust its pairing. Posted for the peers, which learn why at once."""
    if failed is None:
        return
    text = (
        f"{who}: {call} after a failed step ({failed}); build a new runtime on every rank "
        "(messages of the failed step may be left unread); over the torch transport a wait "
        "that timed out also closed its connection: then start the process group (or the "
        "job) again"
    )
    post_failure(text, root=True)
    raise RuntimeError(text)
