"""Output paths checked before a run rather than after it."""

from __future__ import annotations

import os

from .placement import ConfigError


def check_trace_prefix(path_prefix: str, flag: str) -> None:
    """Refuse, before the run rather than after it, a prefix the trace writer
    (:func:`megatron_prt.runtime.trace.write_measured`) cannot write to: its directory must
    exist or be one mkdir away (:class:`ConfigError` naming ``flag``, the directory and the
    fix)."""
    directory = os.path.dirname(os.path.abspath(path_prefix))
    existing = directory if os.path.isdir(directory) else os.path.dirname(directory)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag} {path_prefix}: directory {directory} neither exists nor can be created "
            "(its parent is missing or not writable); create it or choose another PATH"
        )
