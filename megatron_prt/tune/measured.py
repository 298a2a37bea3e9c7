"""Tuning from measurements, the torch-free half (the timing itself runs in
:mod:`megatron_prt.runtime.measured_pick` and :mod:`megatron_prt.runtime.comm_timing`):

* costs from a run's own trace: per model stage, the median forward and backward time of
  the runtime's spans (``PipelineRuntime(trace=True)``, gathered from every rank with
  :func:`megatron_prt.runtime.trace.gather_spans`), as a per-layer cost model for
  :func:`megatron_prt.tune.search_plans.tune_layout` (``--pipeline-reuse auto``, and the
  same steps by hand for the plain-PyTorch runtime: see docs/tune.md);
* the measured final pick: the tuner's top candidates (:func:`top_candidates`) timed in
  interleaved repetitions, the fastest median wins (:func:`pick_fastest`, or
  :func:`fastest` over timings taken by a caller that drives the steps itself, as
  ``--pipeline-reuse auto`` times megatron's training iterations);
* the per-message CPU and the compute scale fitted in place (:func:`message_cpu_in_place`,
  :func:`fit_in_place`).

[Note: measured final pick] The tuner's best candidates are often predicted within 1-2%
of each other, finer than the cost model resolves (its per-message and per-step terms are
fitted, not exact). So the final choice among the top few is made by the clock: each runs
a few steps on the actual ranks and transport, in a shuffled order each round ([Note:
shuffled rounds]) so that none always follows the same other one, and the smallest median
wins; a tie goes to the better predicted. Every step's time is the slowest rank's, so every
rank holds the same
numbers and picks the same plan. Near twins (the same configuration with zb's or ZB-H2's
cap, an even or a balanced split) are predicted within a fraction of a percent and measure
within the noise of each other, so timing five of them tells the clock little; with
``per_configuration`` the top K are K different configurations, each in its best predicted
form, which is where the model's blind spots (per-step and per-message terms that depend on
the configuration) lie.
"""

from __future__ import annotations

import math
import random
import statistics
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from ..core.actions import Op
from ..core.actions import parse as parse_action
from ..core.layers import check_stage_layers
from ..core.placement import ConfigError, Placement
from ..core.plan import Plan
from ..sim.cost import CostModel, LayerCost
from ..sim.simulate import simulate
from .search_plans import Candidate, TuneResult

T = TypeVar("T")


def stage_times(placement: Placement, gathered: list) -> tuple[list[float], list[float], float]:
    """Per model stage: median forward and backward seconds over every traced span of
    every rank (``gathered[rank][iteration]``: spans ``(action, start, end)``); a split
    backward counts as its I plus its W. Also W's share of the backward (0 when whole)."""
    fwd, bwd = defaultdict(list), defaultdict(list)
    i_w: dict = defaultdict(float)
    w_total = b_total = 0.0
    for rank, rank_iterations in enumerate(gathered):
        for iteration, spans in enumerate(rank_iterations):
            for action, start, end in spans:
                k = placement.model_stage(action.stage)
                if action.op is Op.F:
                    fwd[k].append(end - start)
                elif action.op is Op.B:
                    bwd[k].append(end - start)
                else:
                    i_w[(rank, iteration, action.stage, action.mb)] += end - start
                    w_total += (end - start) if action.op is Op.W else 0.0
                    b_total += end - start
    for (_, _, stage, _), seconds in i_w.items():
        bwd[placement.model_stage(stage)].append(seconds)
    missing = [k for k in range(placement.depth) if not fwd[k] or not bwd[k]]
    if missing:
        raise ConfigError(
            f"no traced forward or backward for model stages {missing}; trace a training "
            "step (PipelineRuntime(trace=True), not forward only) on every rank and gather "
            "every rank's spans"
        )
    medians = [statistics.median(fwd[k]) for k in range(placement.depth)]
    back = [statistics.median(bwd[k]) for k in range(placement.depth)]
    return medians, back, (w_total / b_total if b_total else 0.0)


def stage_bytes(placement: Placement, timelines: list) -> list[float] | None:
    """Per model stage: the median activation bytes one micro-batch's forward keeps, from
    every rank's :meth:`~megatron_prt.runtime.PipelineRuntime.memory_stats` timeline
    (``timelines[rank]``: ``(action label, bytes held after it)``; a forward's rise is what
    it kept). None when some stage ran no forward in them (nothing to price it by)."""
    kept = defaultdict(list)
    for timeline in timelines:
        before = 0
        for label, held in timeline:
            action = parse_action(label)
            if action.op is Op.F:
                kept[placement.model_stage(action.stage)].append(max(held - before, 0))
            before = held
    if any(not kept[k] for k in range(placement.depth)):
        return None
    return [float(statistics.median(kept[k])) for k in range(placement.depth)]


def measured_cost(
    placement: Placement,
    stage_layers: Sequence[int],
    gathered: list,
    split_backward: bool,
    act_bytes: Sequence[float] | None = None,
) -> CostModel:
    """A per-layer cost model in seconds: each model stage's measured time spread evenly
    over its layers (the split is fixed, so only stage sums matter); a stage without
    layers keeps its time as the embedding (stage 0) or head (last stage), and a middle one
    as the work every stage's step does ([Note: an empty middle stage measured]). Memory:
    each stage's measured ``act_bytes`` (:func:`stage_bytes`) spread the same way, the
    embedding and the head in their stages' bytes; without them, in layer activations
    (``act`` 1 per layer and per such end stage), where a head whose logits outweigh a
    layer's activations is undercounted."""
    counts = check_stage_layers(stage_layers, sum(stage_layers), placement.depth)
    fwd, bwd, w_share = stage_times(placement, gathered)
    if act_bytes is not None and len(act_bytes) != placement.depth:
        raise ConfigError(
            f"act_bytes gives {len(act_bytes)} stages, the placement has D = R*P = "
            f"{placement.depth}; give one per model stage (stage_bytes makes them)"
        )
    act = list(act_bytes) if act_bytes is not None else [float(max(n, 1)) for n in counts]
    # W at the measured share of each stage's backward where the split is run
    wgrad = [w_share * b if split_backward else None for b in bwd]
    stage = _empty_middle_work(counts, fwd, bwd)
    if stage is not None:  # the other stages' measured times include it: out of F and I
        fwd = [max(f - stage.fwd, 0.0) for f in fwd]
        bwd = [max(b - stage.bwd, w or 0.0) for b, w in zip(bwd, wgrad, strict=True)]
    layers: list[LayerCost] = []
    ends: dict[int, LayerCost] = {}
    for k, n in enumerate(counts):
        w = None if wgrad[k] is None else wgrad[k] / max(n, 1)
        if n:
            layers += [LayerCost(fwd[k] / n, bwd[k] / n, act=act[k] / n, wgrad=w)] * n
        elif k in (0, placement.depth - 1):
            ends[k] = LayerCost(fwd[k], bwd[k], act=act[k], wgrad=w)
    return CostModel(
        layers=tuple(layers),
        embedding=ends.get(0),
        head=ends.get(placement.depth - 1),
        stage_layers=counts,
        wgrad_fraction=w_share if split_backward else None,
        stage=stage,
    )


def _empty_middle_work(counts: Sequence[int], fwd, bwd) -> LayerCost | None:
    """The step's work of a model stage with no layers, neither first nor last (None when
    there is none): the median of such stages' measured times.

    [Note: an empty middle stage measured] A middle stage without layers still runs a
    step (it receives, passes its input on, sends): 0.1-0.2 ms on CPU, and a pipeline
    stage's time on the critical path. Spread over layers it had nowhere to go and was
    priced at 0. The cost model's ``stage`` entry is that work on every stage; the
    measured stages include it, so it is taken out of theirs (out of the forward and, with
    split backward, out of I, at most down to 0; W keeps the measured share of the stage's
    backward): every stage then costs what it measured, exactly where one stage is empty or
    all empty ones measured alike (else each at their median) and no stage's forward or I
    is shorter than that work (else that stage costs more than it measured)."""
    empty = [k for k, n in enumerate(counts) if not n and 0 < k < len(counts) - 1]
    if not empty:
        return None
    return LayerCost(
        statistics.median(fwd[k] for k in empty), statistics.median(bwd[k] for k in empty)
    )


# -- the measured final pick ([Note: measured final pick]) -----------------------------------
def top_candidates(result: TuneResult, k: int, per_configuration: bool = False) -> list[Candidate]:
    """The first ``k`` candidates of ``result`` that fit its budget, best predicted first,
    each a different (plan, layer split): families that build the same plan count once.
    ``per_configuration``: also at most one per configuration (reuse, placement,
    direction, split backward or not), its best predicted plan and split; see
    [Note: measured final pick] for why the clock needs such alternatives."""
    if k < 1:
        raise ConfigError(f"--top must be >= 1 candidate to time, got {k}")
    top: list[Candidate] = []
    for candidate in result.fitting():
        if any(_same_run(candidate, kept) for kept in top):
            continue
        if per_configuration and any(_config(candidate) == _config(kept) for kept in top):
            continue
        top.append(candidate)
        if len(top) == k:
            break
    return top


def _same_run(a: Candidate, b: Candidate) -> bool:
    return a.stage_layers == b.stage_layers and a.plan.compute_only() == b.plan.compute_only()


def _config(candidate: Candidate) -> tuple:
    placement = candidate.plan.placement
    split = candidate.plan.split_backward
    return (placement.reuse, placement.placement, placement.direction, split)


def interleaved_rounds(count: int, reps: int) -> Iterator[list[int]]:
    """``reps`` rounds over ``count`` items, each in its own shuffled order, seeded by the
    round: the same orders on every rank and in every launch.

    [Note: shuffled rounds] Rotating rounds (A B C, B C A, ...) keep each item behind the
    same other one in all but one round in ``count``; a step that runs slower after a
    particular predecessor (caches, the allocator, the transport's threads still busy)
    then biases one item's median the same way every round. A fresh order per round
    spreads the predecessors and the positions."""
    for rep in range(reps):
        order = list(range(count))
        random.Random(rep).shuffle(order)
        yield order


@dataclass(frozen=True)
class MeasuredPick(Generic[T]):
    """``candidates`` in predicted order, ``seconds[i]`` candidate ``i``'s timed steps,
    ``index`` the winner's (the smallest median; a tie to the better predicted)."""

    candidates: tuple[T, ...]
    seconds: tuple[tuple[float, ...], ...]
    index: int

    @property
    def winner(self) -> T:
        return self.candidates[self.index]

    @property
    def medians(self) -> tuple[float, ...]:
        return tuple(statistics.median(s) for s in self.seconds)


def pick_fastest(
    candidates: Sequence[T], time_step: Callable[[int], float], reps: int
) -> MeasuredPick[T]:
    """Time ``reps`` steps of every candidate, interleaved (:func:`interleaved_rounds`):
    ``time_step(i)`` runs one step of candidate ``i`` and returns its seconds (to agree
    across ranks it must return the same number on every rank: the slowest rank's)."""
    if not candidates:
        raise ConfigError("a measured pick needs at least one candidate")
    if reps < 1:
        raise ConfigError(f"--pick-reps must be >= 1 timed step per candidate, got {reps}")
    seconds: list[list[float]] = [[] for _ in candidates]
    for order in interleaved_rounds(len(candidates), reps):
        for i in order:
            seconds[i].append(float(time_step(i)))
    return fastest(candidates, seconds)


def fastest(candidates: Sequence[T], seconds: Sequence[Sequence[float]]) -> MeasuredPick[T]:
    """The pick from timings already taken (``seconds[i]``: candidate ``i``'s timed steps,
    ``candidates`` in predicted order): the smallest median, a tie to the better predicted.
    For callers whose steps are driven from outside (``--pipeline-reuse auto`` times the
    training loop's own iterations in :func:`interleaved_rounds` order)."""
    if not candidates:
        raise ConfigError("a measured pick needs at least one candidate")
    if len(seconds) != len(candidates) or not all(seconds):
        raise ConfigError(
            f"a measured pick needs timed steps for each of its {len(candidates)} candidates, "
            f"got {[len(s) for s in seconds]}"
        )
    medians = [statistics.median(s) for s in seconds]
    index = min(range(len(candidates)), key=lambda i: (medians[i], i))
    return MeasuredPick(tuple(candidates), tuple(tuple(map(float, s)) for s in seconds), index)


# -- per-message CPU fitted in place ([Note: per-message CPU in place]) ----------------------
def message_cpu_in_place(
    cost: CostModel, timed: Sequence[tuple[Plan, float]], warn: bool = True
) -> float:
    """The ``p2p_cpu`` (>= 0) at which the simulated difference of the two ``(plan, measured
    seconds)`` in ``timed`` (fewest messages first) equals the measured one; bisection (the
    difference grows with it); 0 when even free messages simulate a larger difference (with
    ``warn``, a warning naming both steps: :func:`_warn_free_messages`). ``cost`` prices both
    plans (give it without ``stage_layers``: each plan then gets its even split); its
    ``p2p_cpu``, the isolated figure, sets the search's upper end (plus ``many``'s seconds). The
    hop's ``p2p_latency`` is left as given (callers derive it from the isolated figure: [Note: a
    hop's time less its CPU]).

    [Note: per-message CPU in place] A message timed on its own costs its ranks a different CPU
    time than one sent inside a step, either way: small messages cost more in a step (read as
    the transport's work competing with the compute for the 2 cores), the tuned grid's wide
    stack's 1 MiB shared-memory messages less (why is not measured; the burst that times them
    alone has both ranks copy at once, 64 messages each way). So the per-message CPU is fitted
    from two timed steps of the same layers, one with few messages and one with many: the CPU
    per message that makes the simulated difference of the two equal the measured one (a
    per-step constant cancels out). It was once kept at or above the isolated figure: on the wide
    stack that floor held in every launch, and with it the many-message step itself simulated
    6-17% above its median in the grid's rounds (R = 3 and 4 loop rows up to +18% off); fitted
    below it (0.13 against 0.16-0.20 ms), the rows other than the fitted ones came within 10% in
    40 of 41, against 31 of 39 (docs/tune.md, "The message CPU below the isolated figure")."""
    (few, few_s), (many, many_s) = timed

    def gap(cpu: float) -> float:
        priced = replace(cost, p2p_cpu=cpu)
        return simulate(many, priced).makespan - simulate(few, priced).makespan

    low, high = 0.0, cost.p2p_cpu + many_s
    if gap(low) >= many_s - few_s:
        if warn:
            _warn_free_messages(timed)
        return low
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if gap(mid) < many_s - few_s else (low, mid)
    return (low + high) / 2


def _warn_free_messages(timed: Sequence[tuple[Plan, float]], stacklevel: int = 3) -> None:
    """Warn that the message CPU came out 0 (``stacklevel``: the public function's caller)."""
    (few, few_s), (many, many_s) = timed[:2]
    warnings.warn(
        f"the step with many messages ({_config_label(many)}) measured {many_s:.6f} s and "
        f"the one with few ({_config_label(few)}) {few_s:.6f} s, a gap that even free "
        "messages exceed in the simulator: the per-message CPU is fitted at 0; time both "
        "steps again (more steps) if the host was busy",
        stacklevel=stacklevel,
    )


def _config_label(plan: Plan) -> str:
    c = plan.placement
    return f"P={c.ranks} R={c.reuse} {c.placement}/{c.direction}, m={plan.num_microbatches}"


def hop_in_flight(one_way_s: float, cpu_s: float) -> float:
    """The ``p2p_latency`` of a hop timed one way in ``one_way_s`` on a transport that
    costs each end ``cpu_s`` per message: what is left of the hop once both ends' CPU is
    taken out, never below 0.

    [Note: a hop's time less its CPU] The simulator charges ``p2p_cpu`` to the sender's
    and the receiver's busy time and adds ``p2p_latency`` between them as time in flight,
    during which both ranks may compute. A one-way time measured by ping-pong holds all
    three, so taking it whole as the latency counts the CPU twice, once as in flight. On
    shared memory a message is the sender's copy into the ring and the receiver's copy
    out, nothing in flight: the wide stack's 1 MiB message timed 0.21-0.26 ms one way and
    0.25-0.28 ms of CPU per end, and with the one-way time as latency the simulator
    credited plans built for those costs with hiding it (R = 4 loop/uni 13.6% and R = 1
    loop/bi 4% faster than the plans for free messages) while they ran 0.5-6% slower;
    the tuned grid's wide predictions came out low in 17 of 18 launches (docs/tune.md).
    Every measured wire goes through it: the bench sections' ``wire_fields`` (tuned grid,
    layer stack on gloo and shared memory, BERT) and ``megatron-prt profile``'s hop line
    (``runtime.comm_timing.comm_keys``, less the CPU fitted in place)."""
    return max(0.0, one_way_s - 2 * cpu_s)


MIN_COMPUTE_SCALE = 1e-3  # below it the traced compute is deemed not the step's (no fit)
# The simulator rounds every duration to 1/10,000 of the shortest F, B or message time
# (StageTimes.in_ticks), so
# a simulated step moves in jumps of up to a few millionths of itself as the scale moves: a
# secant can then circle the measured time without coming within a millionth. The closest
# round within a ten-thousandth is the fit (100 times finer than any timed step repeats).
SIMULATED_RESOLUTION = 1e-4
# The split form's scale against the traced split form ([Note: the split form in place]):
# beyond these a split step is not mostly what was traced
MIN_SPLIT_SCALE, MAX_SPLIT_SCALE = 0.25, 4.0


def fit_in_place(
    cost: CostModel, timed: Sequence[tuple[Plan, float]], rounds: int = 50, warn: bool = True
) -> tuple[CostModel, float]:
    """``(cost fitted, compute scale)``: ``cost`` with every compute time times the scale
    (:meth:`~megatron_prt.sim.cost.CostModel.compute_scaled`) and ``p2p_cpu`` refitted
    (:func:`message_cpu_in_place`), so that the simulator reproduces the two measured
    uni steps ``timed[:2]`` (fewest messages first), each plan priced as ``cost`` prices it;
    a further ``(bi plan, seconds)`` also refits ``replica_latency`` (:func:`_replica_in_place`),
    and a ``(split-backward plan, seconds)`` the split form's times (:func:`_split_in_place`),
    in that order. ``warn``: a message CPU or replica latency fitted at 0 warns (a busy
    host's timing, where messages and sums cost something; not for a wire that may cost
    nothing, nor for medians timed elsewhere).

    [Note: compute fitted in place] Per-layer times traced in one launch (every layer its own
    stage, a few steps) move between launches by more than the schedules differ: on the
    2-core machine identical layers' backward spans ranged 0.39-0.78 ms, and whole
    predictions 24% under to 38% over the measured steps, nearly alike for every plan of a
    launch. The two timed steps the per-message fit already takes are steps of the same
    layers: the one with few messages is mostly compute, so it sets the scale of the
    per-layer times; their gap sets the per-message CPU. Alternately: scale so the few-message
    step comes out as measured, refit the message CPU under that scale, until the simulated
    step is within a millionth of the measured one (secant steps: the simulated step is
    nearly linear in the scale, its messages' share fixed), or else the closest round when it
    is within :data:`SIMULATED_RESOLUTION`. The layers' relative times stay as traced."""
    few, few_s = timed[0]
    scale, last = 1.0, None  # last: (scale, simulated seconds) of the round before
    closest = (math.inf, None, scale)  # (relative error, fitted, scale) of the best round
    for _ in range(rounds):
        scaled = cost.compute_scaled(scale)
        fitted = replace(scaled, p2p_cpu=message_cpu_in_place(scaled, timed[:2], warn=False))
        predicted = simulate(few, fitted).makespan
        if predicted <= 0:
            raise ConfigError(
                f"the few-message step simulates to {predicted} s: no compute to scale"
            )
        error = abs(few_s / predicted - 1)
        closest = min(closest, (error, fitted, scale), key=lambda c: c[0])
        if error <= 1e-6:
            break
        if last is None or last[1] == predicted:
            step = scale * (few_s / predicted - 1)  # the step is all compute
        else:  # secant: compute scales, the messages' share does not
            step = (few_s - predicted) * (scale - last[0]) / (predicted - last[1])
        last = (scale, predicted)
        scale = scale + step if scale + step > 0 else scale / 2
        if scale < MIN_COMPUTE_SCALE:
            break  # the messages alone outlast the step: no compute scale fits
    error, fitted, best = closest
    if error <= SIMULATED_RESOLUTION:
        return _refit_the_rest(fitted, timed, warn), best
    raise ConfigError(
        f"no compute scale fits (few-message step measured {few_s:.6f} s, simulated "
        f"{predicted:.6f} s at scale {scale:.4g}, {rounds} rounds at most; closest "
        f"{error:.2g} off at scale {best:.4g}): the step with few "
        "messages must be mostly compute; time one with fewer messages or more layers"
    )


def _refit_the_rest(
    fitted: CostModel, timed: Sequence[tuple[Plan, float]], warn: bool
) -> CostModel:
    """After the scale and the message CPU (warned at 0 with ``warn``), each further step:
    a bi one refits the replica latency, a split-backward one the split form."""
    if warn and fitted.p2p_cpu == 0.0:
        _warn_free_messages(timed, stacklevel=4)  # fit_in_place's caller
    for plan, seconds in timed[2:]:
        if plan.split_backward:
            fitted = _split_in_place(fitted, plan, seconds)
        else:
            fitted = _replica_in_place(fitted, plan, seconds, warn)
    return fitted


def _replica_in_place(cost: CostModel, plan: Plan, seconds: float, warn: bool = True) -> CostModel:
    """``cost`` with the ``replica_latency`` (>= 0) at which the bi ``plan`` simulates to
    the measured ``seconds``; bisection (the step grows with it); 0 when even a free sum
    simulates slower. ``cost``'s own figure, the sum timed alone, only sets the search's
    upper end.

    [Note: the replica sum in place] Priced from the replica sum timed alone, bi plans came
    out 0-12% faster, relative to uni plans, than they ran in the same launches (all three
    stacks, four launches): a bi step pays more than its messages and its timed sum. A bi
    plan with few messages, timed beside the two uni steps, sets a per-step cost: the
    replica latency at which it simulates to what it measured, below the figure timed alone
    too, as the message CPU ([Note: per-message CPU in place]): kept at or above it, the
    head stack's fit sat on it once in fifteen stack-runs (0.436 ms, before the grid and in
    its rounds alike) and its bi rows came out 4-13% slow in the grid's rounds. A cost with
    ``tied_grad_bytes`` prices its tied sum at that latency too (the plain stacks fitted
    here tie nothing)."""
    if plan.placement.direction != "bi":
        raise ConfigError(f"the third timed step must be of a bi plan, got {plan.placement}")

    def step(latency: float) -> float:
        return simulate(plan, replace(cost, replica_latency=latency)).makespan

    if step(0.0) >= seconds:
        if not warn:
            return replace(cost, replica_latency=0.0)
        warnings.warn(
            f"the bi step ({_config_label(plan)}) measured "
            f"{seconds:.6f} s, which it outlasts in the simulator even with a free replica "
            "sum: the replica latency is fitted at 0; time it again (more steps) if the host "
            "was busy",
            stacklevel=4,  # fit_in_place's caller
        )
        return replace(cost, replica_latency=0.0)
    high = cost.replica_latency + seconds
    return replace(cost, replica_latency=_bisect(step, seconds, 0.0, high))


def _bisect(step: Callable[[float], float], seconds: float, low: float, high: float) -> float:
    """The value in [``low``, ``high``] where ``step`` (growing) reaches ``seconds``, to 40
    halvings (an end when it does not reach it within)."""
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if step(mid) < seconds else (low, mid)
    return (low + high) / 2


def _split_in_place(cost: CostModel, plan: Plan, seconds: float) -> CostModel:
    """``cost`` with the split form's own times scaled (:meth:`CostModel.split_scaled`, by
    a factor within [:data:`MIN_SPLIT_SCALE`, :data:`MAX_SPLIT_SCALE`]) so that the
    split-backward ``plan`` simulates to the measured ``seconds``; bisection (the step grows
    with the factor). A step beyond the bounds warns and takes the bound.

    [Note: the split form in place] Traced layer by layer, the split form's I + W came out
    21-36% above the whole backward on the tuned grid's stacks, while the split plans ran as
    fast as or faster than the plain ones in the same launches: the traced split form pays
    per-span overhead twice per layer and the deferred W's bookkeeping, which a step mostly
    hides. Predicted 13-39% slow, the split rows could not win the tuner's ranking on the
    equal stack where they won the clock. A split plan with few messages (R = 1 uni, in
    the zero-bubble order the tuner builds for the costs: the order for equal unit stages
    ran 5-10% slower on two of the tuned grid's stacks while priced alike:
    ``benchmarks/split_orders.py``), timed beside
    the others, sets the split form's scale as the few-message step sets the compute
    scale."""

    def step(factor: float) -> float:
        return simulate(plan, cost.split_scaled(factor)).makespan

    ends = {scale: step(scale) for scale in (MIN_SPLIT_SCALE, MAX_SPLIT_SCALE)}
    if ends[MIN_SPLIT_SCALE] > seconds or ends[MAX_SPLIT_SCALE] < seconds:
        bound = MIN_SPLIT_SCALE if ends[MIN_SPLIT_SCALE] > seconds else MAX_SPLIT_SCALE
        warnings.warn(
            f"the split-backward step ({plan.placement}, m={plan.num_microbatches}) measured "
            f"{seconds:.6f} s, simulating to {ends[bound]:.6f} s with the split form at "
            f"{bound}x as traced, the fit's bound: split plans are priced at that bound and "
            "their predictions are off; time the split step again on a quieter machine, or "
            "trace the layers again",
            stacklevel=3,
        )
        return cost.split_scaled(bound)
    return cost.split_scaled(_bisect(step, seconds, MIN_SPLIT_SCALE, MAX_SPLIT_SCALE))
