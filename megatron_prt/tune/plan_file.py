"""Plan files: a plan with its layer partition, as the runtimes run it.

A plan file is :meth:`megatron_prt.core.plan.Plan.to_dict` (the config, ``stage_to_rank``,
``pipelines``, ``ranks`` ...) plus::

    "stage_layers": [3, 3, 2, ...],   # transformer layers of model stages 0..D-1
    "num_layers": 24,                 # their sum, the model's --num-layers
    "tuned": {...}                    # optional: what `megatron-prt tune` predicted

``config`` repeats ``stage_layers`` and ``num_layers`` so the file reads on its own.
``megatron-prt tune -o FILE`` writes one; :func:`load_plan` reads it for the plain-PyTorch
runtime (``build_stages(plan.placement, rank, make_layer, file.num_layers, file.stage_layers)``
and ``PipelineRuntime(file.plan, ...)``), ``--pipeline-reuse-plan FILE`` for megatron-core and
``megatron-prt simulate --plan FILE`` for the simulator. The plan runs exactly as written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..core.layers import check_stage_layers
from ..core.placement import ConfigError
from ..core.plan import Plan
from ..core.validate import validate


@dataclass(frozen=True)
class PlanFile:
    """``plan``: compute-only and valid; ``stage_layers``: one count per model stage."""

    plan: Plan
    stage_layers: tuple[int, ...]
    tuned: dict | None = None

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    def to_dict(self) -> dict:
        data = self.plan.to_dict()
        layers = {"stage_layers": list(self.stage_layers), "num_layers": self.num_layers}
        data["config"].update(layers)
        data.update(layers)
        if self.tuned is not None:
            data["tuned"] = self.tuned
        return data

    def write(self, path: str) -> None:
        """Write the file; :class:`ConfigError` naming ``path`` if it cannot be written."""
        try:
            with open(path, "w") as f:
                f.write(json.dumps(self.to_dict(), indent=1) + "\n")
        except OSError as exc:
            raise ConfigError(
                f"-o {path}: {exc.strerror or exc}; choose a file in a writable directory"
            ) from exc


def load_plan(path: str, flag: str = "--plan") -> PlanFile:
    """Read and check a plan file. Raises :class:`ConfigError` starting with ``flag`` and
    ``path`` for a missing or unreadable file, text that is not JSON, a plan that does not
    parse or validate, or ``stage_layers`` that do not give one count per model stage."""
    where = f"{flag} {path}"
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(
            f"{where}: {exc.strerror or exc}; give a plan file (`megatron-prt tune -o FILE` "
            "writes one)"
        ) from exc
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(data, dict) or "stage_layers" not in data:
        raise ConfigError(
            f"{where}: no stage_layers in the file; plan files come from `megatron-prt tune "
            "-o FILE` (a bare `megatron-prt plan --format json` lacks the partition)"
        )
    try:
        plan = Plan.from_dict(data).compute_only()
        validate(plan)
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise ConfigError(f"{where}: not a valid plan ({exc})") from exc
    depth = plan.placement.depth
    counts = check_stage_layers(
        data["stage_layers"], sum(data["stage_layers"]), depth, name=f"{where}: stage_layers"
    )
    return PlanFile(plan, counts, data.get("tuned"))
