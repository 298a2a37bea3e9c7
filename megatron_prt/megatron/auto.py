"""``--pipeline-reuse auto``: profile the first training iterations, tune, time the best
predicted plans on the next ones, switch to the fastest measured.

The first :attr:`~megatron_prt.megatron.config.ReuseConfig.auto_iterations` training calls
run the plan the flags give (the first is warm-up, metered for activation memory); the
later ones are traced (the runtime's per-action spans: inputs ready to compute done).
After the last of them every pipeline rank's spans and memory timeline are gathered over
the pipeline group, each model stage's forward and backward time is the median over its
micro-batches and replicas, its activation bytes the median its forwards kept
(:func:`~megatron_prt.tune.measured.stage_bytes`), and global rank 0 runs
:func:`megatron_prt.tune.search_plans.tune_layout` on those costs and broadcasts its
:attr:`~megatron_prt.megatron.config.ReuseConfig.auto_candidates` best predicted plans
(``--pipeline-reuse-auto-candidates`` K; distinct plans,
:func:`~megatron_prt.tune.measured.top_candidates`); every rank checks their hash against
rank 0's. With K = 1 (or one distinct plan) the predicted best runs from the next call on.

Otherwise the measured pick ([Note: measured final pick] in
:mod:`megatron_prt.tune.measured`) runs on the training loop's own iterations: each
candidate runs one untimed warm-up call (its runtime built, buffers primed), then
``auto_pick_reps`` timed calls each, in :func:`~megatron_prt.tune.measured.interleaved_rounds`'
seeded shuffled order. A call's time is the slowest rank's, over the whole world (TP and DP
ranks too, so every rank holds the same numbers), from a barrier before the pipeline runs
to the end of megatron's gradient finalize
(:func:`~megatron_prt.runtime.measured_pick.slowest_step_seconds`). The smallest median
wins, a tie to the better predicted (:func:`~megatron_prt.tune.measured.fastest`); the
ranks' picks are gathered and every rank raises should they differ
(:func:`~megatron_prt.runtime.measured_pick.check_same_pick`); rank 0 logs every candidate's
predicted and measured time. Training goes on while measuring: every candidate runs the same
stage modules on the same micro-batches, so each gives the same gradients up to the
summation order (the candidates are restricted to plans of the running placement, layer
split, micro-batch count and backward kind: :func:`same_gradients`); with dropout, the mask
of a micro-batch follows the RNG draw order, which each plan's forward order sets, as it does
between any two plans. Every switch happens between two iterations (after the gradients
are final, before the optimizer step), so no iteration mixes two plans; the candidates'
runtimes stay built until the final switch.

The model chunks were built for the flags' placement (P, R, loop/wave, uni/bi) and layer
split; rebuilding them mid-run would move parameters and optimizer state between ranks, so
auto keeps both and chooses among the plans for them: the schedule (1F1B or megatron
interleaved where the placement is theirs, PRT), built for equal stages or for the
measured times, and with ``--pipeline-reuse-split-backward`` the split-backward
schedules (whole-backward ones without it: the chunks' backward is not split mid-run).
To change R, placement or the split, tune offline (``megatron-prt tune``) and restart with
``--pipeline-reuse-plan``. Messages are not priced in the prediction (the spans time compute
only); the measured pick's clock sees them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.distributed as dist

from ..core.placement import ConfigError
from ..core.plan import Plan
from ..runtime.measured_pick import check_same_pick, slowest_step_seconds
from ..sim.cost import CostModel
from ..tune.measured import (
    MeasuredPick,
    fastest,
    interleaved_rounds,
    measured_cost,
    stage_bytes,
    top_candidates,
)
from ..tune.plan_file import recompute_setting
from ..tune.search_plans import Candidate, Seed, TuneResult, tune_layout
from .config import ReuseConfig
from .plan_flag import running_shape

LOG_PREFIX = "megatron-prt: --pipeline-reuse auto:"
RUNNING = "running plan"  # the running plan's label among the candidates
chosen: list[Plan] = []  # the plan of this process's last final switch (tools and tests read it)


@dataclass(frozen=True)
class AutoCandidate:
    """A plan auto may switch to, as rank 0 broadcasts it: ``label`` its schedule family,
    ``planned_for`` what it was built for, ``predicted_s`` the tuner's seconds per iteration."""

    plan: Plan
    label: str
    planned_for: str
    predicted_s: float


class AutoTuner:
    """The profile-tune-measure-switch state of one forward-backward function (module
    docstring). ``step_seconds(i)``, when set, replaces the clock: this rank's seconds for
    one training call of candidate ``i`` (the call still runs; tests)."""

    def __init__(self, reuse: ReuseConfig) -> None:
        self.reuse = reuse
        self.calls = 0
        self.spans: list[list] = []  # this rank's spans of each traced iteration
        self.timeline: list = []  # the warm-up call's activation memory, action by action
        self._metering = False  # what the runtime's measure_memory was before the warm-up
        self.candidates: list[AutoCandidate] = []
        self.queue: list[tuple[int, bool]] = []  # (candidate, timed) of each call still to run
        self.seconds: list[list[float]] = []  # each candidate's timed calls
        self.picked: MeasuredPick[AutoCandidate] | None = None
        self.step_seconds: Callable[[int], float] | None = None
        self.done = False
        self.final: Plan | None = None  # the plan of the final switch, once made

    @property
    def profiling(self) -> bool:
        """Training calls are still profiled or timed (the schedule hands them here)."""
        return not self.done

    def before(self, pipeline) -> None:
        """Trace this training call when it is a profiled one after the warm-up; meter the
        warm-up's activation memory (its saved-tensor hooks cost time, so not on a traced
        call: the tuner prices memory in these bytes, time in the traces)."""
        traced = 0 < self.calls < self.reuse.auto_iterations
        pipeline.trace_enabled = traced or bool(self.reuse.trace_path)
        if self.calls == 0:
            self._metering, pipeline.measure_memory = pipeline.measure_memory, True

    def timed(self, pipeline, call: Callable[[], object]) -> object:
        """Run ``call`` (one training iteration on ``pipeline``) and return what it returns;
        a timed call of the measured pick is timed as the slowest rank's (collective over
        the world)."""
        if not self.queue or not self.queue[0][1]:
            return call()
        index = self.queue[0][0]
        iteration = _Iteration(call)
        local = None if self.step_seconds is None else (lambda: self.step_seconds(index))
        self.seconds[index].append(slowest_step_seconds(iteration, None, pipeline.device, local))
        return iteration.result

    def after(self, pipeline, group) -> Plan | None:
        """After a training call: the plan the next call runs, or ``None`` to keep the
        running one (collective over the pipeline group and the world after the last
        profiled call and after the last timed one). :attr:`done` says whether a switch is
        the final one (while measuring, every call names its candidate's plan)."""
        self.calls += 1
        if self.calls <= self.reuse.auto_iterations:
            return self._after_profiled(pipeline, group)
        self.queue.pop(0)
        if self.queue:
            return self.candidates[self.queue[0][0]].plan
        return self._final(self._measured_winner())

    def _after_profiled(self, pipeline, group) -> Plan | None:
        if self.calls == 1:
            self.timeline = pipeline.memory_stats()["timeline"]
            pipeline.measure_memory = self._metering
        else:
            self.spans.append(pipeline.trace())
        pipeline.trace_enabled = bool(self.reuse.trace_path)
        if self.calls < self.reuse.auto_iterations:
            return None
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (self.spans, self.timeline), group=group)
        spans, timelines = [g[0] for g in gathered], [g[1] for g in gathered]
        act = stage_bytes(pipeline.plan.placement, timelines)
        self.candidates = _agreed_candidates(self.reuse, pipeline.plan, spans, act)
        if len(self.candidates) == 1:
            return self._final(self.candidates[0])
        count, reps = len(self.candidates), self.reuse.auto_pick_reps
        self.queue = [(i, False) for i in range(count)]  # warm-ups: runtimes built, primed
        self.queue += [(i, True) for order in interleaved_rounds(count, reps) for i in order]
        self.seconds = [[] for _ in self.candidates]
        return self.candidates[0].plan

    def _measured_winner(self) -> AutoCandidate:
        self.picked = fastest(self.candidates, self.seconds)
        check_same_pick(
            self.picked.index,
            who=f"{LOG_PREFIX} the measured pick",
            fix="; a rank ran another plan or a timing was not shared. To switch to the "
            "predicted best untimed, set --pipeline-reuse-auto-candidates 1",
        )
        if dist.get_rank() == 0:
            print(describe_pick(self.picked, self.reuse.auto_pick_reps), flush=True)
        return self.picked.winner

    def resume(self, plan: Plan) -> None:
        """Run ``plan``, the final pick a checkpoint saved, from the next call on, profiling
        and timing nothing ([Note: auto's pick is resumed])."""
        self.calls = self.reuse.auto_iterations
        self._final(AutoCandidate(plan, "checkpoint", "the checkpoint's pick", float("nan")))

    def _final(self, winner: AutoCandidate) -> Plan:
        self.done = True
        self.final = winner.plan
        chosen[:] = [winner.plan]
        return winner.plan


class _Iteration:
    """One training call as a :class:`~megatron_prt.runtime.measured_pick.Runner`; megatron's
    training loop zeroes the gradients before it, so ``zero_grad`` leaves them."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.call = call
        self.result: object = None

    def step(self) -> None:
        self.result = self.call()

    def zero_grad(self) -> None:
        pass


def same_gradients(candidate: Candidate, running: Plan, stage_layers: tuple[int, ...]) -> bool:
    """Whether ``candidate`` computes what ``running`` does, up to summation order: the same
    placement (stage modules), layer split, micro-batches and backward kind, so switching
    to it mid-training changes no gradient beyond fp rounding."""
    plan = candidate.plan
    return (
        plan.placement == running.placement
        and tuple(candidate.stage_layers) == tuple(stage_layers)
        and plan.num_microbatches == running.num_microbatches
        and plan.split_backward == running.split_backward
    )


def _agreed_candidates(
    reuse: ReuseConfig, running: Plan, gathered: list, act_bytes: list | None = None
) -> list[AutoCandidate]:
    """Rank 0 tunes and broadcasts its best predicted plans; every rank checks their hash
    against every other rank's. ``act_bytes``: each model stage's measured activation bytes
    per micro-batch (:func:`~megatron_prt.tune.measured.stage_bytes`), else memory is
    counted in layers."""
    payload: list = [None]
    failure = None  # rank 0's error, chained to the one every rank raises
    if dist.get_rank() == 0:
        counts = reuse.layers_per_stage()
        try:
            cost = measured_cost(
                running.placement, counts, gathered, reuse.split_backward, act_bytes
            )
            result = _tuned_within_running_memory(reuse, running, cost, counts)
            top = top_candidates(result, reuse.auto_candidates)
            top = [c for c in top if same_gradients(c, running, counts)]
            if not top:  # tune_layout keeps the layout, so its winner always qualifies
                raise ConfigError(
                    "no tuned plan keeps the running placement, layer split and backward; "
                    "report this with the flags, or set --pipeline-reuse-plan"
                )
            print(describe(result, running, cost, len(gathered[0]), len(top)), flush=True)
            payload = [[_candidate_dict(c) for c in top]]
        except Exception as exc:  # every rank waits in the broadcast: tell them why
            failure = exc  # (any error: a rank-0-only raise left the others hanging)
            payload = [{"error": str(exc) if isinstance(exc, ConfigError) else repr(exc)}]
    dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise ConfigError(
            f"{LOG_PREFIX} tuning on rank 0 failed: {payload[0]['error']}"
        ) from failure
    candidates = [AutoCandidate(Plan.from_dict(d.pop("plan")), **d) for d in payload[0]]
    digest = hashlib.sha256(" ".join(plan_hash(c.plan) for c in candidates).encode()).hexdigest()
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest[:16])
    if len(set(digests)) != 1:
        raise ConfigError(
            f"{LOG_PREFIX} ranks hold different plans after the broadcast (hashes "
            f"{sorted(set(digests))}); rank {dist.get_rank()} has {digest[:16]}"
        )
    return candidates


def _tuned_within_running_memory(
    reuse: ReuseConfig, running: Plan, cost: CostModel, counts: tuple[int, ...]
) -> TuneResult:
    """:func:`tune_layout`'s ranking with the running plan among the candidates, and only
    plans whose busiest rank holds no more activation bytes than the running plan's
    (``cost`` prices each stage at its metered bytes, :func:`measured_cost`): auto switches
    neither to a plan that is only predicted faster than the one it could keep, nor to
    one that needs more memory than the job was started with (split backward's plans
    held 2-4x the running plan's activations)."""
    result = tune_layout(  # the running plan a candidate even where no schedule builds
        cost,
        running.placement,
        running.num_microbatches,
        split_backward=reuse.split_backward,
        seeds=[Seed(RUNNING, running, counts)],
    )  # (zb's byte caps at m = 1 on unequal metered bytes: auto aborted a run that worked)
    held = next(c for c in result.ranked if c.planned_for == "seed").peak_bytes
    fits = [c for c in result.ranked if c.fits(held)]
    return replace(result, budget_bytes=held, winner=fits[0])


def _candidate_dict(candidate: Candidate) -> dict:
    return {
        "plan": candidate.plan.to_dict(),
        "label": candidate.label,
        "planned_for": candidate.planned_for,
        "predicted_s": candidate.makespan,
    }


# [Note: auto's pick is resumed] A run resumed from a checkpoint profiled again: other
# plans, so other dropout masks (R >= 2 or bi) in the iterations it profiled, and perhaps
# another pick, so it did not continue the uninterrupted run's numbers (8.19315 against
# 8.19366 at iteration 7). A checkpoint saved after the final switch holds the pick
# (:func:`pick_record`, with the conditions it was timed under: :func:`pick_conditions`);
# a resume under the same placement, layer split, micro-batch count, backward kind and
# conditions runs it from its first iteration, profiling nothing (:func:`resume_pick`). A
# checkpoint saved while auto still profiled holds none, and the resumed run profiles afresh.
def pick_record(schedule, reuse: ReuseConfig, conditions: dict | None = None) -> dict | None:
    """What a checkpoint saves of auto's final pick: ``schedule`` is the installed
    forward-backward function; ``conditions``: what it was timed under
    (:func:`pick_conditions`); None before the final switch or without auto."""
    auto = getattr(schedule, "auto", None)
    if auto is None or auto.final is None:
        return None
    # JSON text: a checkpoint's common state loads with torch.load(weights_only=True)
    record = {"plan": auto.final.to_json(None), "stage_layers": list(reuse.layers_per_stage())}
    if conditions is not None:
        record["conditions"] = json.dumps(conditions, sort_keys=True)
    return record


def pick_conditions(args) -> dict:
    """What a pick is timed under beyond the layout :func:`resume_pick` compares: the model
    shape the flags give (sequence length, micro-batch size, precision, layer spec ...;
    :func:`~megatron_prt.megatron.plan_flag.running_shape`), the recomputation, and the
    device (from the process group: NCCL runs on GPUs). A pick timed under others is not
    resumed: it was fastest there, not here."""
    recompute = recompute_setting(
        getattr(args, "recompute_granularity", None),
        getattr(args, "recompute_method", None),
        getattr(args, "recompute_num_layers", None),
        getattr(args, "recompute_activations", False),
    )
    device = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return {**running_shape(args), "recompute": recompute, "device": device}


def resume_pick(
    schedule,
    reuse: ReuseConfig,
    record: dict | None,
    m: int,
    where: str,
    same_grid: bool,
    conditions: dict | None = None,
) -> str:
    """Run ``record`` (:func:`pick_record`'s, from the checkpoint ``where``) from the next
    call of ``schedule`` on when it fits the run (``m`` micro-batches per iteration;
    ``same_grid``: the checkpoint's tensor, pipeline and data-parallel sizes, under which the
    pick was timed; ``conditions``: this run's :func:`pick_conditions`, compared with the
    record's where it has them); the line the log says either way."""
    if record is None:
        return f"{LOG_PREFIX} {where} holds no pick (saved before it was made): profiling again"
    try:
        plan = Plan.from_dict(json.loads(record["plan"]))
    except (ValueError, KeyError, TypeError) as exc:  # another format version, or damaged
        return f"{LOG_PREFIX} {where}'s pick is unreadable ({exc}): profiling again"
    differs = [
        name
        for name, same in (
            ("tensor/pipeline/data-parallel grid", same_grid),
            ("placement", plan.placement == reuse.placement),
            ("layer split", tuple(record["stage_layers"]) == reuse.layers_per_stage()),
            ("micro-batch count", plan.num_microbatches == m),
            ("backward kind", plan.split_backward == reuse.splits_backward),
        )
        if not same
    ]
    differs += _other_conditions(record.get("conditions"), conditions)
    if differs:
        return f"{LOG_PREFIX} {where}'s pick is for another {', '.join(differs)}: profiling again"
    schedule.resume_auto(plan)
    return (
        f"{LOG_PREFIX} running {where}'s pick (plan {plan_hash(plan)}) from the first "
        "iteration, profiling nothing"
    )


def _other_conditions(saved: str | None, conditions: dict | None) -> list[str]:
    """The :func:`pick_conditions` keys whose values differ between the record's (JSON
    text; a record from before they were kept has none: nothing to compare) and this run's."""
    if saved is None or conditions is None:
        return []
    try:
        before = json.loads(saved)
    except (TypeError, ValueError):
        return ["timing conditions (unreadable)"]
    now = json.loads(json.dumps(conditions, sort_keys=True))  # as saved: lists, not tuples
    keys = sorted(set(before) | set(now))
    return [
        f"{key} ({before.get(key)!r} -> {now.get(key)!r})"
        for key in keys
        if before.get(key) != now.get(key)
    ]


def plan_hash(plan: Plan) -> str:
    """SHA-256 of the plan's canonical JSON (what every rank compares)."""
    text = json.dumps(plan.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe(
    result: TuneResult, running: Plan, cost: CostModel, iterations: int, timing: int = 1
) -> str:
    """The log line of rank 0 after tuning: what was measured, predicted and chosen (or,
    ``timing`` > 1, how many of the best predicted plans are timed next)."""
    w = result.winner
    was = next((c for c in result.ranked if c.plan == running), None)
    before = f"{1e3 * was.makespan:.2f} ms" if was else "not among the candidates"
    priced = cost.split_form() if running.split_backward else cost
    times = priced.stage_times(running.placement)
    stages = ", ".join(
        f"{1e3 * f:.2f}/{1e3 * b:.2f}" for f, b in zip(times.fwd, times.bwd, strict=True)
    )
    then = (
        f"timing the {timing} best predicted plans on the next training iterations "
        "(--pipeline-reuse-auto-candidates)"
        if timing > 1
        else "plan hash " + plan_hash(w.plan)
    )
    return (
        f"{LOG_PREFIX} {iterations} traced iterations, per model stage F/B ms {stages}; "
        f"{'chose' if timing == 1 else 'predicted best'} {w.label}, {planned_for(w)}: "
        f"predicted {1e3 * w.makespan:.2f} ms per "
        f"iteration (running plan: {before}); {len(result.ranked)} plans scored. The layer "
        f"split {','.join(map(str, cost.stage_layers))} and placement are kept (the model "
        f"chunks are built for them); {then}"
    )


def planned_for(candidate: AutoCandidate | Candidate) -> str:
    """What a candidate's plan was built for, in the log's words: auto keeps the flags'
    layer split, so the tuner's "equal stages" is equal stage *times* (the split may be
    uneven) and its "costs" the times traced in the first iterations."""
    if candidate.planned_for == "seed":
        return "kept from the start"
    said = {"equal stages": "equal stage times", "costs": "the traced stage times"}
    return "plan for " + said.get(candidate.planned_for, candidate.planned_for)


def describe_pick(picked: MeasuredPick[AutoCandidate], reps: int) -> str:
    """The log line of rank 0 after the measured pick: every candidate's predicted and
    measured (median of the slowest rank's) time per iteration, the one kept."""
    rows = "; ".join(
        f"{c.label} ({planned_for(c)}) predicted {1e3 * c.predicted_s:.2f} ms, measured "
        f"{1e3 * median:.2f} ms" + (" <- chosen" if i == picked.index else "")
        for i, (c, median) in enumerate(zip(picked.candidates, picked.medians, strict=True))
    )
    return (
        f"{LOG_PREFIX} measured pick, median of {reps} timed iterations each (slowest rank): "
        f"{rows}; switching to {picked.winner.label}, plan hash {plan_hash(picked.winner.plan)}"
    )
