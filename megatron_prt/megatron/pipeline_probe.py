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
    during iteration 1; under ``--pipeline-reuse auto``, once auto's final switch is made)
    and gathered at log intervals only. Activation memory is measured
    on one iteration, the next: its saved-tensor hooks cost time, and the schedule and
    shapes repeat every iteration, so one measurement holds for all."""

    forward_backward: Any
    runtime: Any = None
    own_peak: int | None = None
    peak_bytes: list[int] | None = None  # per pipeline rank, once gathered

    def after_iteration(self) -> None:
        """Call after every training iteration (local, no collective). Follows the runtime
        of the last iteration: after ``--pipeline-reuse auto`` switches plans, the bubble and
        memory are the new plan's (they stayed the first plan's). While auto profiles and
        times its candidates their runtimes are left alone (tracing would change what the
        measured pick times)."""
        current = prt_runtime(self.forward_backward)
        auto = getattr(self.forward_backward, "auto", None)
        if current is None or (auto is not None and not auto.done):
            return
        if current is not self.runtime:
            self.runtime, self.own_peak, self.peak_bytes = current, None, None
            current.trace_enabled = True
            current.measure_memory = True  # for the next iteration only
        elif current.measure_memory:
            self.own_peak = int(current.memory_peak())
            current.measure_memory = False

    @property
    def plan(self):
        """The plan of the runtime measured, ``None`` before there is one."""
        return None if self.runtime is None else self.runtime.plan

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


def predicted_bubble(reuse, microbatches: int, plan=None) -> float | None:
    """The simulator's bubble (uniform stages, free communication) for ``plan``, the plan
    that ran (e.g. :attr:`PipelineProbe.plan`); without one, ``reuse``'s plan file or the
    plan built for its placement."""
    if reuse is None:
        return None
    from ..core import build_plan
    from ..sim.simulate import simulate

    plan = plan or reuse.plan or build_plan(reuse.placement, microbatches)
    return simulate(plan).bubble_fraction
