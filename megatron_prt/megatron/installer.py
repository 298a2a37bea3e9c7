"""Swap megatron's pipeline schedule for PRT wherever megatron looks it up.

megatron-core resolves the schedule with ``get_forward_backward_func()``, bound by name in
``megatron.core.pipeline_parallel``, its ``schedules`` module and (Megatron-LM)
``megatron.training.training``; :func:`install` replaces all three, :func:`uninstall` puts
the originals back.

A ``get_forward_backward_func`` looked up before :func:`install` (``from
megatron.core.pipeline_parallel import get_forward_backward_func`` at import time) is
megatron's own: it returns one of megatron's schedules, which would run chunks built for PRT
in megatron's order (under ``wave`` or ``bi``, another model). Those schedules are looked up
as globals of megatron's ``schedules`` module when called, so :func:`install` puts a guard
there too: it refuses model chunks :func:`~megatron_prt.megatron.prepare_model` prepared, and
passes any other model to megatron's schedule unchanged.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable

from ..core.placement import ConfigError
from .config import ReuseConfig
from .model import is_prepared
from .schedule import make_forward_backward_func

_SITES = (
    "megatron.core.pipeline_parallel",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.training.training",
)
_MEGATRON_SCHEDULES = (  # what megatron's own get_forward_backward_func returns
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
)
_ORIGINALS: dict[str, object] = {}
_INSTALLED: dict[str, object] = {}


def install(
    reuse: ReuseConfig | None,
    timeout_s: float | None = None,
    wrap: Callable[[Callable], Callable] | None = None,
) -> bool:
    """Use PRT for ``reuse`` (``None``: PRT not configured, nothing changes). Idempotent;
    installing another config replaces the previous one. Returns whether PRT is installed.

    ``timeout_s`` bounds every wait on a peer rank before :class:`PipelineError` names it;
    ``None``: ``reuse.timeout_s`` (``--pipeline-reuse-timeout``, default 60 s). ``wrap``:
    what megatron calls is ``wrap(forward_backward)`` (a caller's work around every call,
    e.g. Megatron-LM's glue), applied when this call installs."""
    if reuse is None:
        return bool(_INSTALLED)
    if timeout_s is None:
        timeout_s = reuse.timeout_s
    elif not timeout_s > 0:
        raise ValueError(f"install: timeout_s must be > 0 seconds, got {timeout_s}")
    if _INSTALLED.get("reuse") == reuse and _INSTALLED.get("timeout_s") == timeout_s:
        return True
    forward_backward = make_forward_backward_func(reuse, timeout_s)
    if wrap is not None:
        forward_backward = wrap(forward_backward)

    def get_forward_backward_func(pp_size=None, vp_size=None, schedule_pg_collection=None):
        # Megatron-LM from core_v0.19 passes its process groups; PRT runs on megatron's
        # model-parallel groups (those Megatron-LM passes unless given others).
        _refuse_multi_module(schedule_pg_collection)
        return forward_backward

    get_forward_backward_func.reuse = reuse  # type: ignore[attr-defined]
    for name in _sites():
        module = sys.modules[name]
        _ORIGINALS.setdefault(name, module.get_forward_backward_func)
        module.get_forward_backward_func = get_forward_backward_func
    _guard_megatron_schedules()
    _INSTALLED.update(reuse=reuse, func=forward_backward, timeout_s=timeout_s)
    return True


def _refuse_multi_module(schedule_pg_collection) -> None:
    """megatron-core 0.19's multi-module collection (one pipeline per module, e.g. a vision
    encoder beside a language model) selects its bridge schedule; a PRT plan is one model's
    pipeline, so it is refused rather than run over the wrong stages."""
    if type(schedule_pg_collection).__name__ == "MultiModuleProcessGroupCollection":
        raise ConfigError(
            "megatron-prt runs one model's pipeline; get_forward_backward_func was given a "
            "MultiModuleProcessGroupCollection (megatron's multi-module bridge schedule): train "
            "that model without --pipeline-reuse (megatron_prt.megatron.uninstall())"
        )


def uninstall() -> None:
    """Restore megatron's own schedule lookup (no-op when not installed)."""
    for name, original in _ORIGINALS.items():
        module, _, attr = name.partition(":")
        setattr(sys.modules[module], attr or "get_forward_backward_func", original)
    _ORIGINALS.clear()
    _INSTALLED.clear()


def teardown() -> None:
    """End a run's distributed state, last thing before the process exits: PRT uninstalled
    (the installed schedule keeps its runtimes, which hold the model chunks, their DDP and
    its process groups), megatron's model-parallel groups destroyed, then every process
    group, and what held them collected now, so gloo joins its worker threads while the
    interpreter can still give them the GIL ([Note: the default group must end with
    destroy_process_group]: a 2-rank pretrain_bert exited with some 50 gloo threads alive,
    where one still releasing its last collective's tensors aborts the process). Call it
    after a barrier when peers may still be reading."""
    import gc
    import warnings
    import weakref

    import torch.distributed as dist
    from megatron.core import parallel_state

    uninstall()
    parallel_state.destroy_model_parallel()
    default = weakref.ref(dist.group.WORLD) if dist.is_initialized() else None
    if default is not None:
        dist.destroy_process_group()
    gc.collect()
    if default is not None and default() is not None:
        warnings.warn(
            "the default process group outlived destroy_process_group: something still holds "
            "it (torch.distributed.nn.functional imported after init_process_group does), "
            "and a gloo group alive into interpreter shutdown can abort the process; import "
            "megatron_prt.runtime before init_process_group",
            stacklevel=2,
        )


def _guard_megatron_schedules() -> None:
    module = sys.modules["megatron.core.pipeline_parallel.schedules"]
    for attr in _MEGATRON_SCHEDULES:
        original = _ORIGINALS.setdefault(f"{module.__name__}:{attr}", getattr(module, attr))
        setattr(module, attr, _refusing_prepared(attr, original))


def _refusing_prepared(name: str, schedule):
    """megatron's ``schedule``, refusing chunks prepared for PRT (see the module's doc)."""

    @functools.wraps(schedule)
    def guarded(*args, **kwargs):
        model = kwargs.get("model")
        chunks = model if isinstance(model, list) else [model]
        if model is not None and is_prepared(chunks):
            raise ConfigError(
                f"megatron's own {name} was called on model chunks prepared for PRT: a "
                "get_forward_backward_func looked up before megatron_prt.megatron.install() "
                "is megatron's, and would run the chunks in megatron's order (under wave or "
                "bi, another model); look it up after install(), e.g. call "
                "megatron.core.pipeline_parallel.get_forward_backward_func() in the step"
            )
        return schedule(*args, **kwargs)

    return guarded


def installed() -> ReuseConfig | None:
    return _INSTALLED.get("reuse")


def _sites() -> list[str]:
    """Sites that import here; Megatron-LM's training module is optional (megatron-core alone
    has none), and is not imported just to be patched."""
    found = []
    for name in _SITES:
        if name not in sys.modules and name.startswith("megatron.core"):
            importlib.import_module(name)
        if name in sys.modules:
            found.append(name)
    return found
