"""What PRT's runtime measures of the pipeline during training: the bubble of an iteration from
its per-action spans, each pipeline rank's peak activation memory, and the simulator's
prediction for the plan to compare them with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


def prt_runtime(forward_backward) -> Any | None:
    """The PRT runtime (MegatronPipeline) behind PRT's forward-backward function after its
    first call, ``None`` for megatron's own schedule or before that call."""
    pipeline = getattr(forward_backward, "pipeline", None)
    return pipeline() if callable(pipeline) else None


def measured_bubble(spans: Sequence[Sequence[tuple]]) -> float | None:
    """1 - (compute time of all ranks) / (P * makespan) for one iteration's spans
    ``[(action, start_s, end_s), ...]`` per pipeline rank (each rank's clock starts at its
    own step start). ``None`` without spans."""
    ends = [end for row in spans for _, _, end in row]
    if not ends:
        return None
    busy = sum(end - start for row in spans for _, start, end in row)
    return 1.0 - busy / (len(spans) * max(ends))


@dataclass
class PipelineProbe:
    """Per-action spans and activation memory of PRT's runtime (inert for megatron's own
    schedule). Spans are recorded every iteration once the runtime exists (it is built
    during iteration 1) and gathered at log intervals only. Activation memory is measured
    on one iteration, the next: its saved-tensor hooks cost time, and the schedule and
    shapes repeat every iteration, so one measurement holds for all."""

    forward_backward: Any
    runtime: Any = None
    own_peak: int | None = None
    peak_bytes: list[int] | None = None  # per pipeline rank, once gathered

    def after_iteration(self) -> None:
        """Call after every training iteration (local, no collective)."""
        if self.runtime is None:
            self.runtime = prt_runtime(self.forward_backward)
            if self.runtime is not None:
                self.runtime.trace_enabled = True
                self.runtime.measure_memory = True  # for the next iteration only
        elif self.runtime.measure_memory:
            self.own_peak = int(self.runtime.memory_peak())
            self.runtime.measure_memory = False

    def measure(self) -> tuple[float | None, list[int] | None]:
        """``(bubble of the last training iteration, per-rank peak activation bytes)``,
        ``None`` for what is not measured (yet). Collective over the pipeline group."""
        from megatron.core import parallel_state

        from ..runtime.trace import gather_spans

        if self.runtime is None:
            return None, None
        group = parallel_state.get_pipeline_model_parallel_group()
        bubble = measured_bubble(gather_spans(self.runtime, group))
        if self.peak_bytes is None:
            peaks: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(peaks, self.own_peak, group=group)
            self.peak_bytes = None if None in peaks else peaks
        return bubble, self.peak_bytes


def predicted_bubble(reuse, microbatches: int) -> float | None:
    """The simulator's bubble for the plan (uniform stages, free communication)."""
    if reuse is None:
        return None
    from ..core import build_plan
    from ..sim.simulate import simulate

    return simulate(build_plan(reuse.placement, microbatches)).bubble_fraction
