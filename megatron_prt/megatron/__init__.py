"""megatron-core integration: the only package of megatron-prt that imports megatron.

``config`` and ``args`` load without megatron (flags are validated before it loads); the
rest is imported on first use.
"""

from .config import ReuseConfig

__all__ = [
    "ReuseConfig",
    "build_chunks",
    "connect_model_hooks",
    "embedding_ranks",
    "install",
    "make_forward_backward_func",
    "model_provider",
    "prepare_model",
    "teardown",
    "transformer_config_kwargs",
    "uninstall",
]

_LAZY = {
    "build_chunks": "model",
    "connect_model_hooks": "model",
    "embedding_ranks": "model",
    "model_provider": "model",
    "prepare_model": "model",
    "transformer_config_kwargs": "model",
    "install": "installer",
    "uninstall": "installer",
    "teardown": "installer",
    "make_forward_backward_func": "schedule",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
