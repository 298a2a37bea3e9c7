"""SIGTERM during a checkpoint save of ``examples/pretrain_bert.py``: torchrun stops every
rank once one fails, and a rank stopped while saving must still say what happened to the
checkpoint (:func:`megatron_prt.megatron.bert_checkpoint.save_checkpoint`). Within
:func:`terminated_raises` SIGTERM raises :class:`Terminated` in the main thread, comes again
until the rank reports ([Note: a swallowed SIGTERM]), and a process forked meanwhile ends on
it as by default."""

from __future__ import annotations

import contextlib
import os
import signal
import threading


class Terminated(BaseException):
    """SIGTERM arrived (torchrun stops the other ranks when one fails)."""

    def __str__(self) -> str:
        return "SIGTERM (the launcher stops every rank once one fails)"


@contextlib.contextmanager
def terminated_raises():
    """Within: SIGTERM raises :class:`Terminated` (main thread only), so a rank stopped by
    its launcher while saving still says what happened to the checkpoint."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        _again_later(terminated)  # [Note: a swallowed SIGTERM]
        raise Terminated

    terminated.saving = True  # type: ignore[attr-defined]  (a child forked meanwhile: below)
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is terminated:
            signal.signal(signal.SIGTERM, previous)


RESEND_S = 1.0  # seconds between deliveries of one SIGTERM until the rank reports


def _again_later(handler) -> None:
    """In :data:`RESEND_S`, SIGTERM to the main thread again, unless ``handler`` is no longer
    SIGTERM's (the rank is reporting: ``bert_checkpoint._stop_saving`` ignores it; or the
    save is over).

    [Note: a swallowed SIGTERM] The signal's handler runs wherever the main thread is, and
    some code ignores what it raises: logging's at-fork hooks print "Exception ignored" and
    go on. A rank whose launcher's SIGTERM landed there while a checkpoint writer forked
    lost its Terminated, waited on, and was killed 30 s later without the save's report
    (seen once in CI). So the handler stays installed and the signal comes again, every
    :data:`RESEND_S`, as a real signal (a blocking call returns to run it), until the
    rank reports."""

    def again() -> None:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    timer = threading.Timer(RESEND_S, again)
    timer.daemon = True
    timer.start()


def _child_terminates_plainly() -> None:
    """In a process forked during a save (the checkpoint writers' workers), SIGTERM ends the
    process as by default: the inherited handler raised the saving rank's
    :class:`Terminated` inside the child's start-up, and the rank, waiting on it, was killed
    by its launcher before it said what happened to the checkpoint."""
    if getattr(signal.getsignal(signal.SIGTERM), "saving", False):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_child_terminates_plainly)
