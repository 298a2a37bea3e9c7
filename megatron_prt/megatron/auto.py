"""``--pipeline-reuse auto``: profile the first training iterations, tune, switch plans.

The first :attr:`~megatron_prt.megatron.config.ReuseConfig.auto_iterations` training calls
run the plan the flags give (the first is warm-up); the later ones are traced (the
runtime's per-action spans: inputs ready to compute done). After the last of them every
pipeline rank's spans are gathered over the pipeline group, each model stage's forward and
backward time is the median over its micro-batches and replicas, and global rank 0 runs
:func:`megatron_prt.tune.search_plans.tune_layout` on those costs and broadcasts the plan it
picks to every rank, which checks the plan's hash against rank 0's. The new plan runs from
the next call on: the switch happens between two iterations (after the gradients are
final, before the optimizer step), so no iteration mixes two plans.

The model chunks were built for the flags' placement (P, R, loop/wave, uni/bi) and layer
split; rebuilding them mid-run would move parameters and optimizer state between ranks, so
auto keeps both and chooses among the plans for them: the schedule (1F1B or megatron
interleaved where the placement is theirs, PRT), built for equal stages or for the
measured times, and with ``--pipeline-reuse-split-backward`` the split-backward
schedules (whole-backward ones without it: the chunks' backward is not split mid-run).
To change R, placement or the split, tune offline (``megatron-prt tune``) and restart with
``--pipeline-reuse-plan``. Messages are not priced (the spans time compute only).
"""

from __future__ import annotations

import hashlib
import json

import torch.distributed as dist

from ..core.placement import ConfigError
from ..core.plan import Plan
from ..sim.cost import CostModel
from ..tune.measured import measured_cost
from ..tune.search_plans import TuneResult, tune_layout
from .config import ReuseConfig

LOG_PREFIX = "megatron-prt: --pipeline-reuse auto:"
chosen: list[Plan] = []  # the plan of this process's last switch (tools and tests read it)


class AutoTuner:
    """The profile-tune-switch state of one forward-backward function (module docstring)."""

    def __init__(self, reuse: ReuseConfig) -> None:
        self.reuse = reuse
        self.calls = 0
        self.spans: list[list] = []  # this rank's spans of each traced iteration
        self.done = False

    @property
    def profiling(self) -> bool:
        return not self.done

    def before(self, pipeline) -> None:
        """Trace this training call unless it is the warm-up one."""
        pipeline.trace_enabled = self.calls > 0 or bool(self.reuse.trace_path)

    def after(self, pipeline, group) -> Plan | None:
        """Record this call's spans; after the last profiled one, the tuned plan (collective
        over the pipeline group and the world), else ``None``."""
        self.calls += 1
        if self.calls > 1:
            self.spans.append(pipeline.trace())
        pipeline.trace_enabled = bool(self.reuse.trace_path)
        if self.calls < self.reuse.auto_iterations:
            return None
        self.done = True
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, self.spans, group=group)
        plan = _agreed_plan(self.reuse, pipeline.plan, gathered)
        chosen[:] = [plan]
        return plan


def _agreed_plan(reuse: ReuseConfig, running: Plan, gathered: list) -> Plan:
    """Rank 0 tunes and broadcasts; every rank checks the plan's hash against rank 0's."""
    payload: list = [None]
    if dist.get_rank() == 0:
        counts = reuse.layers_per_stage()
        try:
            cost = measured_cost(running.placement, counts, gathered, reuse.split_backward)
            result = tune_layout(
                cost,
                running.placement,
                running.num_microbatches,
                split_backward=reuse.split_backward,
            )
            print(describe(result, running, cost, len(gathered[0])), flush=True)
            payload = [result.winner.plan.to_dict()]
        except ConfigError as exc:  # every rank waits in the broadcast: tell them why
            payload = [{"error": str(exc)}]
    dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise ConfigError(f"{LOG_PREFIX} tuning on rank 0 failed: {payload[0]['error']}")
    plan = Plan.from_dict(payload[0])
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, plan_hash(plan))
    if len(set(digests)) != 1:
        raise ConfigError(
            f"{LOG_PREFIX} ranks hold different plans after the broadcast (hashes "
            f"{sorted(set(digests))}); rank {dist.get_rank()} has {plan_hash(plan)}"
        )
    return plan


def plan_hash(plan: Plan) -> str:
    """SHA-256 of the plan's canonical JSON (what every rank compares)."""
    text = json.dumps(plan.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe(result: TuneResult, running: Plan, cost: CostModel, iterations: int) -> str:
    """The log line of rank 0: what was measured, chosen and predicted."""
    w = result.winner
    was = next((c for c in result.ranked if c.plan == running), None)
    before = f"{1e3 * was.makespan:.2f} ms" if was else "not among the candidates"
    times = cost.stage_times(running.placement)
    stages = ", ".join(
        f"{1e3 * f:.2f}/{1e3 * b:.2f}" for f, b in zip(times.fwd, times.bwd, strict=True)
    )
    return (
        f"{LOG_PREFIX} {iterations} traced iterations, per model stage F/B ms {stages}; "
        f"chose {w.label}, plan for {w.planned_for}: predicted {1e3 * w.makespan:.2f} ms per "
        f"iteration (running plan: {before}); {len(result.ranked)} plans scored. The layer "
        f"split {','.join(map(str, cost.stage_layers))} and placement are kept (the model "
        "chunks are built for them); plan hash " + plan_hash(w.plan)
    )
