"""A sweep of bad inputs and faults: each case ends, on every rank, in an error naming the
problem (checked per rank) or in the right result, within the run's deadline."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time

import pytest
import torch
from parity_models import batch, loss_fn, make_layer
from test_runtime_faults import TIMEOUT_S, WAIT_S, expect_errors, run_case, runtime

from megatron_prt.core import Placement, build_plan
from megatron_prt.core.placement import ConfigError
from megatron_prt.runtime import PipelineRuntime, build_stages, sync_replicas
from megatron_prt.runtime.local import run_local


def _step(rank, world, **kw):
    """Build the default runtime (P = world, R = 2, m = 4) and run one training step."""
    rt, _ = runtime(rank, world, **kw)
    return rt.step(*batch("mlp", 4))


def _stages_of(rank_for_stages):
    def body(rank, world):
        plan = build_plan(Placement(world, 2), 4)
        stages = build_stages(
            plan.placement, rank_for_stages(rank), lambda i: make_layer("mlp", i), 8
        )
        PipelineRuntime(plan, stages, loss_fn, timeout_s=WAIT_S)

    return body


def _other_split(rank, world):
    """Rank 1 builds its stages with another layer split (as from another plan file): each
    rank's stages are right by themselves, and the model lacked layer 3 without a word."""
    plan = build_plan(Placement(world, 2), 4)
    split = (3, 3, 3, 3) if rank == 0 else (4, 2, 3, 3)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 12, split)
    PipelineRuntime(plan, stages, loss_fn, timeout_s=WAIT_S)


def _forward_only_plan(rank, world):
    """A plan of forwards alone trained with zero gradients and the right losses."""
    plan = build_plan(Placement(world, 2), 4).forward_only()
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 8)
    PipelineRuntime(plan, stages, loss_fn, timeout_s=WAIT_S).step(*batch("mlp", 4))


def _extra_stage(rank, world):
    plan = build_plan(Placement(world, 2), 4)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 8)
    if rank == 0:
        stages[7] = torch.nn.Identity()
    PipelineRuntime(plan, stages, loss_fn, timeout_s=WAIT_S)


def _with_batch(change_xs=None, change_ys=None, ranks=(0, 1)):
    def body(rank, world):
        rt, _ = runtime(rank, world)
        xs, ys = batch("mlp", 4)
        if rank in ranks:
            xs = change_xs(xs) if change_xs else xs
            ys = change_ys(ys) if change_ys else ys
        return rt.step(xs, ys)

    return body


def _stage_output(make, transport):
    """Rank 0's first stage replaced by ``make()``: its output is sent to rank 1."""

    def body(rank, world):
        rt, _ = runtime(rank, world, transport=transport)
        if rank == 0:
            rt.stages[0] = make()
        return rt.step(*batch("mlp", 4))

    return body


def _turn_output(make):
    """Under wave R=2 rank 1 holds stages 1 and 2: stage 1's output is handed over on the
    rank, never sent; ``make()`` replaces stage 1."""

    def body(rank, world):
        rt, _ = runtime(rank, world, placement=Placement(world, 2, "wave"))
        if rank == 1:
            rt.stages[1] = make()
        return rt.step(*batch("mlp", 4))

    return body


class _Pair(torch.nn.Module):
    def forward(self, x):
        return x, x


class _Ids(torch.nn.Module):
    def forward(self, x):
        return (x * 100).long()


class _RunsOut(torch.nn.Module):
    """Reads its data from an iterator of three micro-batches (a megatron data_iterator)."""

    def __init__(self):
        super().__init__()
        self.data = iter(range(3))

    def forward(self, x):
        next(self.data)
        return x


class _Single(torch.nn.Module):
    def forward(self, x):
        return x.float()


def _loss_per_element(rank, world):
    plan = build_plan(Placement(world, 2), 4)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 8)
    rt = PipelineRuntime(
        plan, stages, lambda out, y: (out - y) ** 2, dtype=torch.float64, timeout_s=WAIT_S
    )
    return rt.step(*batch("mlp", 4))


def _loss_without_graph(rank, world):
    """A loss computed from a detached output trained with every gradient zero."""
    plan = build_plan(Placement(world, 2), 4)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 8)
    detached = lambda out, y: loss_fn(out.detach(), y)  # noqa: E731
    rt = PipelineRuntime(plan, stages, detached, dtype=torch.float64, timeout_s=WAIT_S)
    return rt.step(*batch("mlp", 4))


def _in_place_on_input(rank, world):
    """Layers starting with ReLU(inplace=True): torch's leaf-variable error named no cause."""

    def make(i):
        return torch.nn.Sequential(torch.nn.ReLU(inplace=True), make_layer("mlp", i))

    plan = build_plan(Placement(world, 2), 4)
    stages = build_stages(plan.placement, rank, make, 8)
    rt = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, timeout_s=WAIT_S)
    return rt.step(*batch("mlp", 4))


def _per_rank(**by_rank):
    """Runtime keyword arguments that differ by rank: ``name=(rank 0's, rank 1's)``."""

    def body(rank, world):
        kw = {name: values[rank] for name, values in by_rank.items()}
        m = kw.pop("m", 4)
        rt, _ = runtime(rank, world, m=m, **kw)
        return rt.step(*batch("mlp", m))

    return body


def _after_close(rank, world):
    rt, _ = runtime(rank, world, transport="shm")
    rt.close()
    return rt.step(*batch("mlp", 4))


def _no_loss_fn_on_rank_0(rank, world):
    """Refused after the plan check, where the peers went on to wait on this rank (in the
    shared-memory set-up): they said it had stopped without reporting an error, after the
    process group's timeout had it not exited."""
    rt, _ = runtime(rank, world, transport="shm", loss_fn=None if rank == 0 else loss_fn)
    return rt.step(*batch("mlp", 4))


def _replica_sum_after_close(rank, world):
    """bi on shared memory: the sum after close() read rings close() had removed (KeyError)."""
    rt, _ = runtime(rank, world, transport="shm", placement=Placement(world, 1, "loop", "bi"))
    rt.step(*batch("mlp", 4))
    rt.close()
    return rt.reduce_replica_grads()


def _replica_frozen_on_one_side(transport):
    """bi: rank 0 freezes model stage 0, its replica on rank 1 trains. The replica sum
    then waited for a payload rank 0 never sent, until ``timeout_s``, naming no cause
    (before empty payloads were skipped, the two sides exchanged unequal sizes)."""

    def body(rank, world):
        placement = Placement(world, 1, "loop", "bi")
        plan = build_plan(placement, 4)
        stages = build_stages(placement, rank, lambda i: make_layer("mlp", i), 8)
        if 0 in stages:
            stages[0].requires_grad_(False)
        rt = PipelineRuntime(
            plan, stages, loss_fn, dtype=torch.float64, timeout_s=TIMEOUT_S, transport=transport
        )
        rt.step(*batch("mlp", 4))
        return rt.reduce_replica_grads()

    return body


def _steps_disagree(transport, gathered=False):
    """Rank 0 evaluates where rank 1 trains (a rank-local condition), then both train: with
    R = 1 both finished that step and rank 0 read rank 1's unread gradients as its next
    step's, 1.5-1.8 relative off, without a word. ``gathered``: gloo taken for a backend
    that ignores tags (NCCL), whose steps are gathered at each start instead."""

    def body(rank, world):
        if gathered:
            from megatron_prt.runtime import messages

            messages.TAGS_IGNORED_BY = ("gloo",)  # this rank's process only
        placement = Placement(world, 1)
        rt, _ = runtime(rank, world, transport=transport, placement=placement, timeout_s=TIMEOUT_S)
        rt.step(*batch("mlp", 4))
        rt.step(*batch("mlp", 4), forward_only=rank == 0)
        return [rt.step(*batch("mlp", 4)) for _ in range(2)]

    return body


def _step_after_a_failed_step(rank, world):
    """A caught step failure, then the same runtime stepped again: messages the failed
    step left in the rings were read by the next step (losses 3.4e-3 off on shared memory)."""
    from megatron_prt.runtime.errors import PipelineError

    rt, _ = runtime(rank, world, transport="shm", timeout_s=TIMEOUT_S)
    inputs, targets = batch("mlp", 4)
    with contextlib.suppress(PipelineError):  # rank 1's loss fails: rank 0 stops waiting
        rt.step(inputs, [t[:, :3] for t in targets] if rank == world - 1 else targets)
    return rt.step(inputs, targets)


def _shm_off_x86(rank, world):
    """transport='shm' asked for by name skipped auto's host checks: on aarch64 the rings,
    which rely on x86's store order, ran (possibly handing out torn messages)."""
    import platform

    platform.machine = lambda: "aarch64"  # this rank's process only
    return _step(rank, world, transport="shm")


def _stall(rank, world):
    rt, _ = runtime(rank, world, timeout_s=TIMEOUT_S)
    if rank == 1:
        time.sleep(600)  # the harness kills this rank
    return rt.step(*batch("mlp", 4))


def _killed_mid_step(transport):
    class Die(torch.nn.Module):
        def forward(self, x):
            os.kill(os.getpid(), signal.SIGKILL)

    def body(rank, world):
        rt, _ = runtime(rank, world, transport=transport)
        if rank == 1:
            rt.stages[3] = Die()  # rank 1's second stage: rank 0 is then waiting on it
        return rt.step(*batch("mlp", 4))

    return body


WAITED = "rank 0 failed first"  # what rank 1 says when rank 0 refused its own arguments
# case id -> (body, substrings every rank reports, per-rank substrings, ranks that answer)
ERROR_CASES = {
    "stages-of-another-rank": (
        _stages_of(lambda rank: 0),
        [],
        {"r1": ["stages [0, 2] given, the plan places [1, 3] here"], "r0": ["rank(s) [1]"]},
    ),
    "extra-stage": (
        _extra_stage,
        [],
        {"r0": ["stages [0, 2, 7] given"], "r1": ["rank(s) [0] were given other stages"]},
    ),
    "targets-too-few": (
        _with_batch(change_ys=lambda ys: ys[:3], ranks=(1,)),
        [],
        {"r1": ["3 targets for 4 micro-batches"], "r0": ["rank 1 failed first"]},
    ),
    "inputs-too-many": (
        _with_batch(change_xs=lambda xs: xs + xs[:1], ranks=(0,)),
        [],
        {"r0": ["5 inputs for 4 micro-batches"], "r1": [WAITED]},
    ),
    "targets-none-at-last-stage": (
        _with_batch(change_ys=lambda ys: None, ranks=(1,)),
        [],
        {"r1": ["targets=None, but this rank holds stage(s) [3]"], "r0": ["rank 1 failed"]},
    ),
    "inputs-generator": (
        _with_batch(change_xs=lambda xs: (x for x in xs), ranks=(0,)),
        [],
        {"r0": ["inputs is a generator; pass a list of 4 tensors"], "r1": [WAITED]},
    ),
    "inputs-dict": (
        _with_batch(change_xs=lambda xs: [{"x": x} for x in xs], ranks=(0,)),
        [],
        {"r0": ["inputs[0] is a dict, not a tensor"], "r1": [WAITED]},
    ),
    "inputs-float32-for-float64-model": (
        _with_batch(change_xs=lambda xs: [x.float() for x in xs], ranks=(0,)),
        [],
        {"r0": ["0F0 (stage 0, mb 0)", "dtype"], "r1": [WAITED]},
    ),
    "tuple-output-torch": (
        _stage_output(_Pair, "torch"),
        ["is a tuple, not a tensor: a stage must return one tensor"],
        {"r1": [WAITED]},
    ),
    "tuple-output-shm": (
        _stage_output(_Pair, "shm"),
        ["is a tuple, not a tensor: a stage must return one tensor"],
        {"r1": [WAITED]},
    ),
    "tuple-output-same-rank": (  # was AttributeError: 'tuple' object has no attribute 'detach'
        _turn_output(_Pair),
        [],
        {"r1": ["stage 1, mb 0: the stage's output is a tuple, not a tensor"], "r0": ["rank 1"]},
    ),
    "integer-output-same-rank": (  # was: only Tensors of floating point dtype can require grad
        _turn_output(_Ids),
        [],
        {
            "r1": ["stage 1, mb 0: the stage's output is torch.int64", "floating point"],
            "r0": ["rank 1"],
        },
    ),
    "data-runs-out": (  # was "StopIteration:" and nothing more
        _stage_output(_RunsOut, "torch"),
        [],
        {
            "r0": ["StopIteration: the data ran out at micro-batch 3 (stage 0): give 4 per call"],
            "r1": [WAITED],
        },
    ),
    "float32-output-shm": (  # shared memory carried any dtype: the torch transport refused it
        _stage_output(_Single, "shm"),
        [],
        {"r0": ["is torch.float32, the runtime sends torch.float64"], "r1": [WAITED]},
    ),
    "loss-per-element": (  # was: the gradients of the summed loss, without a word
        _loss_per_element,
        [],
        {
            "r1": [
                "loss_fn returned a tensor of shape (2, 8) for micro-batch 0 at stage 3",
                "must return a scalar tensor",
            ],
            "r0": ["rank 1"],
        },
    ),
    "layer-split-disagrees": (
        _other_split,
        ["built their stages with another layer split than this rank's", "same num_layers"],
        {"r0": ["ranks [1]", "(3,3,3,3 layers"], "r1": ["ranks [0]", "(4,2,3,3 layers"]},
    ),
    "plan-without-backward": (_forward_only_plan, ["the plan has no backward"], {}),
    "loss-without-graph": (
        _loss_without_graph,
        [],
        {"r1": ["loss that does not require grad for micro-batch 0 at stage 3"], "r0": ["rank 1"]},
    ),
    "in-place-on-input": (
        _in_place_on_input,
        ["ReLU(inplace=True) first", "make that operation out of place"],
        {},
    ),
    "dtype-disagrees": (
        _per_rank(dtype=(torch.float64, torch.float32)),
        [
            "ranks disagree on the dtype (ranks [0] hold dtype torch.float64; "
            "ranks [1] hold dtype torch.float32)",
            "pass the same dtype= on every rank",
        ],
        {},
    ),
    "variable-shapes-disagrees": (
        _per_rank(variable_shapes=(True, False)),
        [
            "ranks disagree on the variable_shapes (ranks [0] hold variable_shapes True; "
            "ranks [1] hold variable_shapes False)"
        ],
        {},
    ),
    "transport-disagrees": (
        _per_rank(transport=("torch", "shm")),
        ["ranks disagree on the transport (ranks [0] hold transport 'torch'; ranks [1] hold "],
        {},
    ),
    "shm-capacity-disagrees": (
        _per_rank(transport=("shm", "shm"), shm_capacity=(None, 1 << 20)),
        [
            "ranks disagree on the shm_capacity (ranks [0] hold shm_capacity None",
            "same shm_capacity=",
        ],
        {},
    ),
    "micro-batches-disagree": (
        _per_rank(m=(4, 2)),  # the message named two hashes and nothing of the plans
        [
            "ranks disagree on the plan",
            "(R=2 loop/uni, 4 micro-batches);",
            "(R=2 loop/uni, 2 micro-batches))",
        ],
        {},
    ),
    "split-backward-on-one-rank": (
        _per_rank(split_backward=(True, False)),
        ["(R=2 loop/uni, 4 micro-batches, split backward)", "split_backward)"],
        {},
    ),
    "uni-and-bi-plans": (
        _per_rank(placement=(Placement(2, 2, direction="bi"), Placement(2, 2))),
        ["ranks disagree on the plan"],
        {},
    ),
    "timeout-zero": (_per_rank(timeout_s=(0, 0)), ["timeout_s=0; pass a positive"], {}),
    "timeout-negative": (_per_rank(timeout_s=(-1, -1)), ["timeout_s=-1"], {}),
    "timeout-nan": (_per_rank(timeout_s=(math.nan, math.nan)), ["timeout_s=nan"], {}),
    "unknown-transport": (
        _per_rank(transport=("nccl", "nccl")),
        ["transport must be auto, torch or shm, got 'nccl'"],
        {},
    ),
    "shm-ring-too-small": (
        _per_rank(transport=("shm", "shm"), shm_capacity=(128, 128)),
        [],
        {"r0": ["pass shm_capacity= of at least"], "r1": [WAITED]},
    ),
    "shm-capacity-zero": (
        _per_rank(transport=("shm", "shm"), shm_capacity=(0, 0)),
        ["shm_capacity must be None (rings sized from the messages) or a whole number"],
        {},
    ),
    "shm-capacity-float": (
        _per_rank(transport=("auto", "auto"), shm_capacity=(1.5e6, 1.5e6)),
        ["shm_capacity must be None", "got 1500000.0"],
        {},
    ),
    "step-after-close": (_after_close, ["step() after close(); build a new runtime"], {}),
    "no-loss-fn-on-rank-0": (_no_loss_fn_on_rank_0, ["rank 0: give loss_fn"], {}),
    "replica-sum-after-close": (
        _replica_sum_after_close,
        ["reduce_replica_grads() after close(); build a new runtime"],
        {},
    ),
    **{
        f"replica-frozen-on-one-side-{transport}": (
            _replica_frozen_on_one_side(transport),
            ["model stage 0 (rank 0) and its bi replica, stage 2 (rank 1)", "freeze"],
            {},
        )
        for transport in ("torch", "shm")
    },
    "shm-off-x86": (_shm_off_x86, ["transport='shm' needs an x86 host", "aarch64"], {}),
    "steps-disagree-shm": (_steps_disagree("shm"), ["every rank must call step() alike"], {}),
    "steps-disagree-torch": (_steps_disagree("torch"), ["with the same forward_only"], {}),
    "steps-disagree-nccl-like": (
        _steps_disagree("torch", gathered=True),
        ["ranks disagree on the step", "ranks [0] hold step 2 (forward-only)"],
        {},
    ),
    "step-after-a-failed-step": (
        _step_after_a_failed_step,
        ["step() after a failed step", "build a new runtime"],
        {},
    ),
    "killed-mid-step-shm": (_killed_mid_step("shm"), ["rank 1", "exited while"], {}),
    "killed-mid-step-torch": (_killed_mid_step("torch"), ["waiting on rank 1"], {}),
}
ANSWERING = {"killed-mid-step-shm": [0], "killed-mid-step-torch": [0]}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_bad_input_fails_clearly_on_every_rank(case):
    body, every, per_rank = ERROR_CASES[case]
    answering = ANSWERING.get(case)
    results = run_case(2, body, wait_for=answering)
    expect_errors(results, *every, ranks=answering, **per_rank)


@pytest.mark.slow
def test_rank_stalling_mid_step_times_out_the_others():
    results = run_case(2, _stall, wait_for={0})
    assert results[1][0] == "killed"
    expect_errors(results, "rank 0, step", "waiting on rank 1", ranks=[0])


def test_wrong_device_fails_clearly():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    results = run_case(2, _per_rank(device=("cuda", "cuda")))
    expect_errors(results, "CUDA", "(stage ")


# -- inputs that are unusual but right --------------------------------------------------------
def test_zero_micro_batches_are_refused_by_the_plan():
    with pytest.raises(ConfigError, match="micro-batches must be an integer >= 1, got 0"):
        build_plan(Placement(2, 2), 0)


def _close_twice(rank, world):
    rt, _ = runtime(rank, world, transport="shm")
    losses = rt.step(*batch("mlp", 4))
    rt.close()
    rt.close()
    return losses


def _nan_input(rank, world):
    rt, _ = runtime(rank, world)
    xs, ys = batch("mlp", 4)
    xs[2] = torch.full_like(xs[2], math.nan)
    return rt.step(xs, ys)


def _stacked_inputs(rank, world):
    rt, _ = runtime(rank, world)
    xs, ys = batch("mlp", 4)
    return rt.step(torch.stack(xs), torch.stack(ys))


def _none_on_middle_rank(rank, world):
    rt, _ = runtime(rank, world, placement=Placement(world, 1))
    xs, ys = batch("mlp", 4)
    return rt.step(xs if rank == 0 else None, ys if rank == world - 1 else None)


@pytest.mark.parametrize(
    "case, body, world",
    [
        ("close-twice", _close_twice, 2),
        ("nan-input", _nan_input, 2),
        ("stacked-tensor-inputs", _stacked_inputs, 2),
        ("none-where-unused", _none_on_middle_rank, 3),
    ],
)
def test_unusual_inputs_give_the_reference_losses(case, body, world):
    results = run_case(world, body)
    for status, payload in results:
        assert status == "ok" and payload["error"] is None, payload
    model = torch.nn.Sequential(*(make_layer("mlp", i) for i in range(8)))
    xs, ys = batch("mlp", 4)
    if case == "nan-input":
        xs[2] = torch.full_like(xs[2], math.nan)
    with torch.no_grad():
        want = [float(loss_fn(model(x), y)) for x, y in zip(xs, ys, strict=True)]
    got = [float(v) for v in results[-1][1]["value"]]
    assert got == pytest.approx(want, rel=1e-12, nan_ok=True)
    assert math.isnan(got[2]) == (case == "nan-input")


def _user_code_fails_between_steps(rank, world):
    rt, _ = runtime(rank, world, transport="torch", placement=Placement(world, 1, "loop", "bi"))
    rt.step(*batch("mlp", 4))
    if rank == 0:
        raise RuntimeError("user code failed between steps")  # out of run_local's function
    start = time.monotonic()
    try:
        rt.reduce_replica_grads()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "elapsed": time.monotonic() - start}
    return {"error": None}


def test_error_outside_the_runtime_is_reported_to_the_peers():
    results = run_local(2, _user_code_fails_between_steps, deadline_s=2 * WAIT_S)
    assert results[0][0] == "error" and "user code failed" in results[0][1]
    expect_errors(
        results,
        "reduce_replica_grads failed: rank 0 failed first",
        "user code failed between steps",
        ranks=[1],
    )


def _batchnorm_warnings(direction):
    def body(rank, world):
        import warnings

        placement = Placement(world, 1, "loop", direction)
        layer = lambda i: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))  # noqa: E731
        stages = build_stages(placement, rank, layer, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PipelineRuntime(build_plan(placement, 4), stages, loss_fn, timeout_s=WAIT_S)
        return [str(w.message) for w in caught]

    return body


def test_bi_stages_with_running_statistics_are_named_once():
    """bi replicas update BatchNorm statistics apart (gradients alone are reduced): said at
    construction, naming the stages; uni says nothing."""
    for direction, said in (("bi", True), ("uni", False)):
        results = run_case(2, _batchnorm_warnings(direction))
        for rank, (status, payload) in enumerate(results):
            assert status == "ok" and payload["error"] is None, payload
            stages = list(Placement(2, 1, "loop", direction).rank_stages[rank])
            running = [m for m in payload["value"] if "running statistics" in m]
            assert len(running) == said
            assert not said or f"stage(s) {stages} keep BatchNorm" in running[0]


class _Counted(torch.nn.Module):
    """A layer that counts its forwards in a buffer (as a moving average would change)."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.layer = make_layer("mlp", i)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return self.layer(x)


def _buffer_warnings(direction):
    def body(rank, world):
        import warnings

        placement = Placement(world, 1, "loop", direction)
        stages = build_stages(placement, rank, _Counted, 4)
        rt = PipelineRuntime(build_plan(placement, 4), stages, loss_fn, dtype=torch.float64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rt.step(*batch("mlp", 4), forward_only=True)  # evaluation: not watched
            for _ in range(2):
                rt.step(*batch("mlp", 4))
        return [str(w.message) for w in caught if "changed in the step" in str(w.message)]

    return body


def test_bi_buffers_a_step_changes_are_named_once():
    """Buffers other than BatchNorm's statistics drifted apart between bi replicas without a
    word; the first training step's changes are named once; uni says nothing."""
    for direction, said in (("bi", 1), ("uni", 0)):
        results = run_case(2, _buffer_warnings(direction))
        for status, payload in results:
            assert status == "ok" and payload["error"] is None, payload
            assert len(payload["value"]) == said, payload["value"]
            assert not said or "0.calls" in payload["value"][0]


def _stall_before(call):
    """Rank 1 stalls (until the harness kills it) before ``call``; rank 0 makes it."""

    def body(rank, world):
        placement = Placement(world, 1, "loop", "bi")
        stages = build_stages(placement, rank, lambda i: make_layer("mlp", i), 4)
        rt = PipelineRuntime(
            build_plan(placement, 4), stages, loss_fn, dtype=torch.float64,
            transport="torch", timeout_s=TIMEOUT_S,
        )  # fmt: skip
        rt.step(*batch("mlp", 4))
        if rank == 1:
            time.sleep(600)
        if call == "reduce":
            rt.reduce_replica_grads()
        else:
            sync_replicas(placement, stages, timeout_s=TIMEOUT_S)

    return body


@pytest.mark.parametrize("call", ["reduce", "sync"])
def test_peer_stalling_before_a_replica_exchange_times_out(call):
    """The torch transport's replica sum and sync_replicas waited without a bound (the
    process group's 30 minutes): now the runtime's ``timeout_s``, naming the silent peer."""
    results = run_case(2, _stall_before(call), wait_for={0})
    assert results[1][0] == "killed"
    what = "reduce_replica_grads" if call == "reduce" else "sync_replicas"
    head = f"rank 0: the placement check of {what}" if call == "sync" else f"rank 0: {what}"
    slowest = expect_errors(results, head, "rank(s) [1]", ranks=[0])  # the silent peer named
    assert slowest < TIMEOUT_S + 30


def _stall_before_the_step_check(rank, world):
    """Tags ignored (NCCL, gloo standing in): rank 1 stalls before its second step."""
    from megatron_prt.runtime import messages

    messages.TAGS_IGNORED_BY = ("gloo",)  # this rank's process only
    rt, _ = runtime(rank, world, placement=Placement(world, 1), timeout_s=TIMEOUT_S)
    rt.step(*batch("mlp", 4))
    if rank == 1:
        time.sleep(600)
    return rt.step(*batch("mlp", 4))


def test_peer_stalling_before_the_step_check_times_out():
    """Where tags are ignored every step starts with a gather of the ranks' steps; it waited
    the process group's timeout (30 minutes) for a stuck peer: now ``timeout_s``."""
    results = run_case(2, _stall_before_the_step_check, wait_for={0})
    assert results[1][0] == "killed"
    slowest = expect_errors(results, "rank 0: the step check failed", "rank(s) [1]", ranks=[0])
    assert slowest < TIMEOUT_S + 30


def _untagged_third(rank, world):
    """Ranks 0 and 1 built with other splits; rank 2 built its stage by hand (no record)."""
    plan = build_plan(Placement(world, 1), 2)
    split = (4, 4, 4) if rank == 0 else (3, 5, 4)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 12, split)
    if rank == 2:
        stages = {s: torch.nn.Sequential(*m) for s, m in stages.items()}
    PipelineRuntime(plan, stages, loss_fn, timeout_s=WAIT_S)


def test_a_rank_without_a_split_record_also_stops_when_the_others_disagree():
    """The rank without a record returned from the check and waited for peers that had
    already failed, until its timeout."""
    results = run_local(3, _untagged_third, deadline_s=120)
    for status, payload in results:
        assert status == "error" and "another layer split" in str(payload), payload
