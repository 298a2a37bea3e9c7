"""Measured timelines: gather the runtime's per-action spans from every rank and write them
with the simulator's renderers (Chrome/Perfetto trace, PNG), so measured and predicted
timelines can be laid side by side."""

from __future__ import annotations

import os

import torch.distributed as dist

from ..sim.render import Span, write_chrome_trace, write_png
from .executor import PipelineRuntime


def gather_spans(runtime: PipelineRuntime, group=None) -> list[list[Span]]:
    """Every rank's spans of its last traced step (seconds), indexed by pipeline rank.

    Collective: all ranks of ``group`` must call it. Clocks are per process; each rank's
    spans start at its own step start, which on one host is within the launch skew."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, runtime.trace(), group=group)
    return gathered


def write_measured(path_prefix: str, spans: list[list[Span]], runtime: PipelineRuntime) -> list:
    """Write ``<prefix>.json`` (Chrome trace) and ``<prefix>.png`` (creating their
    directory); returns the paths."""
    os.makedirs(os.path.dirname(os.path.abspath(path_prefix)), exist_ok=True)
    chunks = runtime.plan.placement.stage_to_chunk
    write_chrome_trace(f"{path_prefix}.json", spans, chunks, unit_us=1e6)
    paths = [f"{path_prefix}.json"]
    try:
        plan = runtime.plan
        c = plan.placement
        title = (
            f"measured: P={c.ranks} R={c.reuse} {c.placement}/{c.direction} "
            f"m={plan.num_microbatches} (seconds)"
        )
        write_png(f"{path_prefix}.png", spans, title, chunks)
        paths.append(f"{path_prefix}.png")
    except RuntimeError:  # matplotlib missing: the trace JSON is still written
        pass
    return paths
