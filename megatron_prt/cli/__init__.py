"""Command-line interface (``megatron-prt`` / ``python -m megatron_prt``)."""

from .main import main

__all__ = ["main"]
