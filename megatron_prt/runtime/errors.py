"""Runtime errors that say where the pipeline stopped."""

from __future__ import annotations

from ..core.actions import Action
from ..core.grid import format_grid


class PipelineError(RuntimeError):
    """A rank could not complete its plan: names rank, step, action, the peer involved and
    shows that rank's plan grid around the step."""


def pipeline_error(plan, rank: int, step: int, action: Action | None, why: str) -> PipelineError:
    where = f"rank {rank}, step {step}"
    if action is not None:
        where += f": {action} (stage {action.stage}, mb {action.mb})"
    return PipelineError(f"{where}: {why}\n{format_grid(plan.ranks, {rank: step})}")
