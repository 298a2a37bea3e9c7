"""Plan files: a plan with its layer partition, as the runtimes run it.

A plan file is :meth:`megatron_prt.core.plan.Plan.to_dict` (the config, ``stage_to_rank``,
``pipelines``, ``ranks`` ...) plus::

    "stage_layers": [3, 3, 2, ...],   # transformer layers of model stages 0..D-1
    "num_layers": 24,                 # their sum, the model's --num-layers
    "tuned": {...}                    # optional: what `megatron-prt tune` predicted, and
                                      # "recompute": [granularity, method, layers] priced,
                                      # "model": the costs' shape (sim/model_shape.py)

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
from ..sim.model_shape import check_shape
from ..sim.recompute import check_recompute

_FIX = "write the file with `megatron-prt tune -o FILE`"


@dataclass(frozen=True)
class PlanFile:
    """``plan``: compute-only and valid; ``stage_layers``: one count per model stage."""

    plan: Plan
    stage_layers: tuple[int, ...]
    tuned: dict | None = None

    @property
    def recompute(self) -> tuple | None:
        """The activation recomputation the plan was tuned under (megatron's granularity,
        method and layers, None each when off); None when the file does not say."""
        given = (self.tuned or {}).get("recompute")
        return None if given is None else tuple(given)

    @property
    def model(self) -> dict | None:
        """The model shape the plan was tuned for (:mod:`megatron_prt.sim.model_shape`);
        None when the file does not say."""
        return (self.tuned or {}).get("model")

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
    parse or validate, ``stage_layers`` that do not give one count per model stage or split
    no layer, a ``tuned`` that is not an object, a ``tuned.recompute`` megatron's rules
    refuse, or a malformed ``tuned.model``."""
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
    except KeyError as exc:
        raise ConfigError(f"{where}: not a valid plan (no {exc} in the file); {_FIX}") from exc
    except (TypeError, ValueError, AttributeError, ConfigError) as exc:
        raise ConfigError(f"{where}: not a valid plan ({exc})") from exc
    if not plan.has_backward:  # it validates (evaluation runs such plans) but trains nothing
        raise ConfigError(
            f"{where}: the plan has no backward (no B, nor I and W): it would train with zero "
            f"gradients; {_FIX}"
        )
    tuned = data.get("tuned")
    if tuned is not None and not isinstance(tuned, dict):
        raise ConfigError(
            f"{where}: tuned must be an object (what `megatron-prt tune` predicted), got "
            f"{tuned!r}; {_FIX}"
        )
    recompute = (tuned or {}).get("recompute")
    if recompute is not None:
        _check_recompute(recompute, where)
    try:
        check_shape((tuned or {}).get("model"), "tuned.model")
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}; {_FIX}") from None
    stage_layers = _stage_layers(data, plan.placement.depth, where)
    _check_tuned_repeats(tuned or {}, plan, stage_layers, where)
    return PlanFile(plan, stage_layers, tuned)


def _check_tuned_repeats(tuned: dict, plan: Plan, stage_layers: tuple, where: str) -> None:
    """``tuned`` predicted for this plan: the placement and split it repeats agree with the
    file's (an edited plan kept the old prediction, which ``simulate`` and the logs quote)."""
    own = {**plan.placement.to_dict(), "stage_layers": list(stage_layers)}
    for key, want in own.items():
        if key in tuned and tuned[key] != want:
            raise ConfigError(
                f"{where}: tuned.{key} {tuned[key]!r} disagrees with the plan's {want!r} (the "
                f"prediction is of another plan); {_FIX}, or drop tuned"
            )


def _check_recompute(recompute: object, where: str) -> None:
    """``tuned.recompute``: ``[granularity, method, layers]`` that megatron's rules accept."""
    if not (isinstance(recompute, list) and len(recompute) == 3):
        raise ConfigError(
            f"{where}: tuned.recompute must be [granularity, method, layers], got "
            f"{recompute!r}; {_FIX}"
        )
    try:
        check_recompute(*recompute)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{where}: tuned.recompute {recompute!r}: {exc}; {_FIX}") from None


def _stage_layers(data: dict, depth: int, where: str) -> tuple[int, ...]:
    """The file's ``stage_layers``, checked: a list of counts, one per model stage, that
    ``num_layers`` and ``config`` (where the file gives them) repeat."""
    raw = data["stage_layers"]
    if not isinstance(raw, list) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in raw
    ):
        raise ConfigError(
            f"{where}: stage_layers must be a list of whole layer counts, one per model stage, "
            f"got {raw!r}; {_FIX}"
        )
    counts = check_stage_layers(raw, sum(raw), depth, name=f"{where}: stage_layers")
    if not sum(counts):
        raise ConfigError(
            f"{where}: stage_layers {list(counts)} split no layer at all (a plan file splits "
            f"the model's transformer layers); {_FIX}"
        )
    config = data.get("config", {})
    for key, given, own in (
        ("num_layers", data.get("num_layers"), sum(counts)),
        ("config.num_layers", config.get("num_layers"), sum(counts)),
        ("config.stage_layers", config.get("stage_layers"), list(counts)),
    ):
        if given is not None and given != own:
            raise ConfigError(
                f"{where}: {key} {given!r} disagrees with stage_layers {list(counts)} "
                f"(which gives {own!r}); fix the file or write it again with `megatron-prt "
                "tune -o FILE`"
            )
    return counts


def recompute_of(cost) -> list:
    """A cost model's recomputation as :attr:`PlanFile.recompute` records it."""
    return recompute_setting(
        cost.recompute_granularity, cost.recompute_method, cost.recompute_num_layers
    )


def recompute_setting(granularity, method=None, layers=None, activations=False) -> list:
    """megatron's recomputation flags as one value: method and layers only under ``full``
    (where megatron reads them); ``activations`` (Megatron-LM's ``--recompute-activations``)
    is ``selective``, as Megatron-LM's own argument check makes it."""
    if granularity is None and activations:
        granularity = "selective"
    if granularity != "full":
        return [granularity, None, None]
    return ["full", method, layers]


def describe_recompute(setting) -> str:
    """A :func:`recompute_setting` in words, e.g. ``full (uniform, 1 layer(s))``."""
    granularity, method, layers = setting
    if granularity is None:
        return "none"
    return granularity if method is None else f"{granularity} ({method}, {layers} layer(s))"
