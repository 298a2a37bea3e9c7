"""Faults that used to end in a wrong result, a hang, a raw gloo error or a dead process:
each now ends, on every rank, in an error naming the problem and the fix (or in the right
result). Ranks are local gloo processes (:func:`megatron_prt.runtime.local.run_local`)."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from parity_models import (
    HIDDEN,
    NUM_LAYERS,
    batch,
    loss_fn,
    make_layer,
    reference,
    train_errors,
)

from megatron_prt.core import Placement, build_plan
from megatron_prt.core.actions import Op
from megatron_prt.core.lower import lower
from megatron_prt.runtime import PipelineRuntime, build_stages, sync_replicas
from megatron_prt.runtime.errors import PipelineError
from megatron_prt.runtime.local import run_local
from megatron_prt.runtime.p2p import SHM_FREE_ENV, TorchTransport
from megatron_prt.runtime.rings import RING_BOUND
from megatron_prt.runtime.stages import layer_ranges

TIMEOUT_S = 4.0  # where a test waits for a timeout to fire
WAIT_S = 60.0  # everywhere else: generous, so a loaded machine cannot fail a run


def attempt(rank, world, body):
    """Run ``body(rank, world)``: ``{"error": text or None, "value", "elapsed"}``."""
    start = time.monotonic()
    try:
        value = body(rank, world)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "elapsed": time.monotonic() - start}
    return {"error": None, "value": value, "elapsed": time.monotonic() - start}


def run_case(world, body, deadline_s=2 * WAIT_S, wait_for=None):
    results = run_local(world, attempt, body, deadline_s=deadline_s, wait_for=wait_for)
    return results


def expect_errors(results, *every, ranks=None, **per_rank):
    """Every rank in ``ranks`` (default all) reported an error containing all of ``every``
    (and ``per_rank["r<k>"]`` for rank k). Returns the slowest time to error."""
    ranks = range(len(results)) if ranks is None else ranks
    slowest = 0.0
    for rank in ranks:
        status, payload = results[rank]
        assert status == "ok", f"rank {rank}: {status}: {payload}"
        text = payload["error"]
        assert text is not None, f"rank {rank} finished without an error: {payload}"
        for want in (*every, *per_rank.get(f"r{rank}", ())):
            assert want in text, f"rank {rank}: {want!r} not in:\n{text}"
        slowest = max(slowest, payload["elapsed"])
        print(f"rank {rank} after {payload['elapsed']:.2f} s: {text.splitlines()[0]}")  # pytest -s
    return slowest


def runtime(rank, world, m=4, layers=8, transport="torch", **kw):
    """A P = world, R = 2 MLP runtime (float64) with its stages."""
    placement = kw.pop("placement", None) or Placement(world, 2)
    plan = build_plan(placement, m)
    stage_layers = kw.pop("stage_layers", None)
    stages = build_stages(
        plan.placement, rank, lambda i: make_layer("mlp", i), layers, stage_layers
    )
    kw.setdefault("dtype", torch.float64)
    kw.setdefault("timeout_s", WAIT_S)
    if transport == "shm":  # rings from the start: the faults below hit the first step
        kw.setdefault("shm_capacity", 1 << 20)
    rt = PipelineRuntime(plan, stages, kw.pop("loss_fn", loss_fn), transport=transport, **kw)
    return rt, stages


def reference_losses(xs, ys, layers=8):
    model = torch.nn.Sequential(*(make_layer("mlp", i) for i in range(layers)))
    with torch.no_grad():
        return [float(loss_fn(model(x), y)) for x, y in zip(xs, ys, strict=True)]


def ragged_batch(sizes):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, HIDDEN, generator=g, dtype=torch.float64) for n in sizes]
    ys = [torch.randn(n, HIDDEN, generator=g, dtype=torch.float64) for n in sizes]
    return xs, ys


# -- 1. shapes and dtype on the torch transport ---------------------------------------------
@pytest.mark.parametrize("transport", ["torch", "shm", "shm-sized"])
@pytest.mark.parametrize(
    "sizes, forward_only",
    [
        ((2, 1, 2, 2), True),
        ((2, 1, 2, 2), False),
        ((2, 2, 3, 2), True),
        ((2, 2, 3, 2), False),
        ((2, 2, 2, 2, 1, 1, 1, 1), False),  # a smaller last batch, at the second step
    ],
    ids=["shorter-fwd", "shorter-train", "longer-fwd", "longer-train", "next-step"],
)
def test_varying_shapes_without_flag_fail_on_every_rank(sizes, forward_only, transport):
    """The shared-memory transport carried them (a run on one CPU host passed and failed on
    GPUs over NCCL): both refuse alike, the rings from their sizing step on."""

    def body(rank, world):
        sized = {"shm_capacity": None} if transport == "shm-sized" else {}  # after step 1
        rt, _ = runtime(rank, world, transport=transport.split("-")[0], **sized)
        for start in range(0, len(sizes), 4):
            rt.step(*ragged_batch(sizes[start : start + 4]), forward_only=forward_only)

    results = run_case(2, body)
    expect_errors(
        results,
        "the activation sent to stage 1 has shape",
        "variable_shapes=True",
        r1=["rank 0 failed first"],
    )


@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_varying_shapes_with_flag_give_the_reference_losses(transport):
    xs, ys = ragged_batch((2, 1, 3, 2))

    def body(rank, world):
        rt, _ = runtime(rank, world, transport=transport, variable_shapes=True)
        return [rt.step(xs, ys, forward_only=True), rt.step(xs, ys)]

    results = run_case(2, body)
    want = reference_losses(xs, ys)
    for status, payload in results:
        assert status == "ok" and payload["error"] is None, payload
    for losses in results[1][1]["value"]:  # rank 1 holds the last stage
        assert [float(v) for v in losses] == pytest.approx(want, rel=1e-12)


def test_float64_model_with_default_dtype_names_the_dtype_argument():
    def body(rank, world):
        rt, _ = runtime(rank, world, dtype=torch.float32)
        return rt.step(*batch("mlp", 4))

    results = run_case(2, body)
    expect_errors(results, "dtype=torch.float64", r1=["rank 0 failed first"])


# -- 2. shared memory ------------------------------------------------------------------------
def test_explicit_shm_without_room_names_shm_size():
    def body(rank, world):
        os.environ[SHM_FREE_ENV] = str(1 << 20)
        runtime(rank, world, transport="shm")  # two rings of 1 MiB

    results = run_case(2, body)
    expect_errors(results, "shm_capacity=1048576", "--shm-size", "--ipc=host")


def test_sized_rings_without_room_name_shm_size_after_the_first_step():
    def body(rank, world):
        os.environ[SHM_FREE_ENV] = str(16 << 10)  # less than two rings of RING_FLOOR
        rt, _ = runtime(rank, world, transport="shm", shm_capacity=None)
        return rt.step(*batch("mlp", 4))

    results = run_case(2, body)
    expect_errors(results, "rings sized from the first step's messages", "--shm-size")


@pytest.mark.parametrize("capacity", [1 << 20, None], ids=["shm_capacity", "sized"])
def test_auto_without_room_falls_back_to_torch(capacity):
    xs, ys = batch("mlp", 4)

    def body(rank, world):
        os.environ[SHM_FREE_ENV] = str(16 << 10)
        warnings = []
        handler = logging.Handler()
        handler.emit = lambda record: warnings.append(record.getMessage())
        logging.getLogger("megatron_prt").addHandler(handler)
        rt, _ = runtime(rank, world, transport="auto", shm_capacity=capacity)
        losses = [rt.step(xs, ys, forward_only=True), rt.step(xs, ys, forward_only=True)]
        return isinstance(rt.transport, TorchTransport), losses, warnings

    results = run_case(2, body)
    for status, payload in results:
        assert status == "ok" and payload["error"] is None, payload
        assert payload["value"][0]
    warned = [w for _, payload in results for w in payload["value"][2]]
    assert len(warned) == 1 and "--shm-size" in warned[0], warned
    for losses in results[1][1]["value"][1]:
        assert [float(v) for v in losses] == pytest.approx(reference_losses(xs, ys), rel=1e-12)


@pytest.mark.parametrize(
    "placement", [Placement(2, 2), Placement(2, 2, "wave", "bi")], ids=["uni", "bi"]
)
def test_rings_sized_from_the_messages_train_as_the_reference(placement):
    """/dev/shm too small for 32 MiB rings (the old size of every ring) holds the rings
    sized from the messages; three training steps (the first over torch.distributed while
    they are sized, bi's replica sums through them after) match the unpipelined model."""
    m = 4
    refs = reference("mlp", m)
    xs, ys = batch("mlp", m)

    def body(rank, world):
        os.environ[SHM_FREE_ENV] = str(4 << 20)
        plan = build_plan(placement, m)
        stages = build_stages(placement, rank, lambda i: make_layer("mlp", i), NUM_LAYERS)
        try:
            PipelineRuntime(plan, stages, loss_fn, transport="shm", shm_capacity=32 << 20)
        except PipelineError as exc:
            refused = str(exc)
        sync_replicas(placement, stages)
        rt = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, transport="shm")
        ranges = layer_ranges(NUM_LAYERS, placement.depth)
        err, seen = train_errors(rt, stages, placement, refs, xs, ys, 3, ranges)
        return refused, type(rt.transport).__name__, err, seen

    results = run_case(2, body)
    seen = set()
    for status, payload in results:
        assert status == "ok" and payload["error"] is None, payload
        refused, wire, err, mine = payload["value"]
        assert "shm_capacity=33554432" in refused and wire == "ShmTransport"
        assert max(err.values()) < 1e-10, err
        seen |= mine
    assert seen == set(range(m))


def test_ring_holds_a_steps_messages_and_a_later_larger_one_names_shm_capacity():
    """Each ring holds its largest message times the messages it carries in a step (the
    lowered plan's receives), so a step never waits for room; a later, longer micro-batch
    (variable_shapes) that outgrows its ring is refused naming shm_capacity."""
    rows = 512  # 32 KiB float64 activations: rings well above RING_FLOOR, far below 32 MiB
    xs, ys = ragged_batch((rows,) * 4)
    plan = build_plan(Placement(2, 2), 4)

    def body(rank, world):
        os.environ[SHM_FREE_ENV] = str(4 << 20)
        rt, _ = runtime(rank, world, transport="shm", shm_capacity=None, variable_shapes=True)
        losses = [rt.step(xs, ys, forward_only=True), rt.step(xs, ys)]
        capacity = rt.transport.pair_bytes(1 - rank)
        longer = ragged_batch((rows, 32 * rows, rows, rows))
        try:
            rt.step(*longer, forward_only=True)
        except PipelineError as exc:
            return losses, capacity, str(exc)
        return losses, capacity, None

    results = run_case(2, body, deadline_s=4 * WAIT_S)
    want = reference_losses(xs, ys)
    for losses in results[1][1]["value"][0]:
        assert [float(v) for v in losses] == pytest.approx(want, rel=1e-12)
    lowered = lower(plan)
    for rank, (status, payload) in enumerate(results):
        assert status == "ok" and payload["error"] is None, payload
        _, capacity, _ = payload["value"]
        receives = sum(a.op in (Op.RECV_F, Op.RECV_B) for a in lowered.ranks[rank])
        assert receives * rows * HIDDEN * 8 <= capacity < 32 << 20
    assert "shm_capacity= of at least" in results[0][1]["value"][2]


def test_replica_sum_before_any_step_goes_through_shared_memory():
    """A replica sum before the first step (the replica-sum calibration does this) builds
    the rings then: their messages unknown, they get RING_BOUND, and later steps use them."""
    xs, ys = batch("mlp", 4)

    def body(rank, world):
        placement = Placement(world, 1, "loop", "bi")
        rt, stages = runtime(rank, world, transport="shm", shm_capacity=None, placement=placement)
        for module in stages.values():
            for p in module.parameters():
                p.grad = torch.full_like(p, rank + 1.0)
        rt.reduce_replica_grads()
        summed = all(torch.all(p.grad == 3.0) for m in stages.values() for p in m.parameters())
        wire = type(rt.transport).__name__
        return summed, wire, rt.transport.pair_bytes(1 - rank), rt.step(xs, ys, forward_only=True)

    results = run_case(2, body)
    for status, payload in results:
        assert status == "ok" and payload["error"] is None, payload
        assert payload["value"][:3] == (True, "ShmTransport", RING_BOUND)
    losses = [v for _, payload in results for v in payload["value"][3] if v is not None]
    assert sorted(map(float, losses)) == pytest.approx(sorted(reference_losses(xs, ys)))


def test_rings_of_one_message_each_cannot_deadlock():
    """Both ranks of P = 2 R = 2 send before they receive; with rings that hold one message
    each and no receive posted ahead, each used to wait for room in the other's ring until
    the timeout. A rank that waits now empties its inbound rings."""
    xs, ys = batch("mlp", 4)

    def body(rank, world):
        rt, _ = runtime(
            rank, world, transport="shm", shm_capacity=256, recv_lookahead=0, timeout_s=TIMEOUT_S
        )
        return [rt.step(xs, ys) for _ in range(2)]

    results = run_case(2, body)
    for status, payload in results:
        assert status == "ok" and payload["error"] is None, payload
    for losses in results[1][1]["value"]:
        assert [float(v) for v in losses] == pytest.approx(reference_losses(xs, ys), rel=1e-12)


def test_shm_segments_are_unlinked_and_stale_ones_removed():
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    stale = f"/dev/shm/prt{'ab' * 6}_{dead}_0_1"
    with open(stale, "wb") as handle:
        handle.write(b"\0" * 64)

    def body(rank, world):
        rt, _ = runtime(rank, world, transport="shm")
        dist.barrier()
        mine = tuple(f"_{pid}_" for pid in rt.transport.pids)
        names = sorted(
            n for n in os.listdir("/dev/shm") if n.startswith("prt") and any(p in n for p in mine)
        )
        rt.close()
        return names

    results = run_case(2, body)
    for status, payload in results:
        assert status == "ok" and payload["error"] is None, payload
        assert payload["value"] == [], payload["value"]  # every name unlinked once attached
    assert not os.path.exists(stale)


# -- 3. a plan for fewer ranks than the group ------------------------------------------------
def test_plan_for_fewer_ranks_than_group_is_refused_everywhere():
    def body(rank, world):
        # every rank past gloo's connect first: ranks 0 and 1 refuse at once and exit, which
        # failed rank 2's process-group set-up when it was still connecting (seen in CI)
        dist.barrier()
        placement = Placement(2, 2)
        plan = build_plan(placement, 4)
        stages = build_stages(placement, min(rank, 1), lambda i: make_layer("mlp", i), 8)
        PipelineRuntime(plan, stages, loss_fn, timeout_s=WAIT_S)

    results = run_case(3, body)
    expect_errors(results, "the plan is for P = 2 pipeline ranks, the group has 3", "group=")


# -- 4. ranks that disagree on the direction ---------------------------------------------------
def test_direction_disagreement_is_named_by_sync_replicas():
    def body(rank, world):
        placement = Placement(world, 2, direction="bi" if rank == 0 else "uni")
        stages = build_stages(placement, rank, lambda i: make_layer("mlp", i), 8)
        sync_replicas(placement, stages)  # README order: before the runtime
        runtime(rank, world, placement=placement)

    results = run_case(2, body)
    expect_errors(results, "ranks disagree on the placement", "P=2 R=2 loop bi", "P=2 R=2 loop uni")


@pytest.mark.parametrize("world", [1, 2])
def test_sync_replicas_of_a_placement_for_more_ranks_is_refused(world):
    """One process launched for a P = 2 (or 4) bi placement: sync_replicas waited forever on
    a send to a rank the group lacks."""

    def body(rank, world):
        placement = Placement(2 * world, 1, direction="bi")
        stages = build_stages(placement, rank, lambda i: make_layer("mlp", i), 8)
        sync_replicas(placement, stages, timeout_s=TIMEOUT_S)

    results = run_case(world, body, deadline_s=60)
    expect_errors(results, f"the group has {world} rank(s)", f"--nproc-per-node {2 * world}")


# -- 5. inputs the stages cannot take ----------------------------------------------------------
@pytest.mark.parametrize(
    "make, want",
    [
        (lambda xs: None, "inputs=None, but this rank holds stage(s) [0]"),
        (lambda xs: [(x, x) for x in xs], "inputs[0] is a tuple, not a tensor"),
    ],
    ids=["none", "tuples"],
)
def test_unusable_inputs_are_named(make, want):
    def body(rank, world):
        rt, _ = runtime(rank, world)
        xs, ys = batch("mlp", 4)
        return rt.step(make(xs) if rank == 0 else xs, ys)

    results = run_case(2, body)
    expect_errors(results, want, r1=["rank 0 failed first"])


# -- 6. a first stage without layers --------------------------------------------------------------
@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_empty_first_stage_passes_the_input_through(transport):
    xs, ys = batch("mlp", 4)
    shapes = [x.shape for x in xs]
    originals = [x.clone() for x in xs]

    def body(rank, world):
        rt, stages = runtime(rank, world, transport=transport, stage_layers=[0, 3, 3, 2])
        fwd = rt.step(xs, ys, forward_only=True)
        train = rt.step(xs, ys)
        intact = all(
            x.shape == s and torch.equal(x, o)
            for x, s, o in zip(xs, shapes, originals, strict=True)
        )
        grads = {
            stage: [p.grad.clone() for p in module.parameters()] for stage, module in stages.items()
        }
        return fwd, train, intact, grads

    results = run_case(2, body)
    for status, payload in results:
        assert status == "ok" and payload["error"] is None, payload
        assert payload["value"][2], "the caller's inputs changed"
    model = torch.nn.Sequential(*(make_layer("mlp", i) for i in range(8)))
    per_mb = [loss_fn(model(x), y) for x, y in zip(xs, ys, strict=True)]
    (sum(per_mb) / 4).backward()
    want = [v.item() for v in per_mb]
    fwd, train, _, _ = results[1][1]["value"]
    assert [float(v) for v in fwd] == pytest.approx(want, rel=1e-12)
    assert [float(v) for v in train] == pytest.approx(want, rel=1e-12)
    # stage 1 (rank 1) holds layers 0..2: its gradients are the reference's
    got = results[1][1]["value"][3][1]
    ref = [p.grad for i in range(3) for p in model[i].parameters()]
    for g, r in zip(got, ref, strict=True):
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-14)


# -- 7. a dead rank -------------------------------------------------------------------------------
def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def test_rank_killed_before_the_plan_check_is_named():
    """A killed rank posts nothing: its peers wait their ``timeout_s`` (under torchrun the
    launcher stops them first), then name it."""

    def body(rank, world):
        dist.barrier()  # every rank past gloo's connect: the death hits the plan check
        if rank == 1:
            _die()
        runtime(rank, world, timeout_s=TIMEOUT_S)

    results = run_case(2, body, wait_for={0})
    assert results[1][0] == "killed"
    expect_errors(results, "the plan check at start-up failed", "rank(s) [1] stopped", ranks=[0])


def test_rank_stalling_before_the_plan_check_leaves_nothing_in_flight():
    """Rank 0 waits ``timeout_s`` and raises. The check used to be an all_gather that stayed
    in flight: tearing the group down (or exiting) waited for the stalled peer, so a
    launcher never saw rank 0 fail. It goes through the group's store now."""

    def body(rank, world):
        if rank == 1:
            time.sleep(600)
        try:
            runtime(rank, world, timeout_s=TIMEOUT_S)
        except PipelineError:
            dist.destroy_process_group()  # waited for the stalled peer before
            raise

    results = run_case(2, body, deadline_s=TIMEOUT_S + 30, wait_for={0})
    assert results[1][0] == "killed"
    # rank 0 reported before the harness's deadline: it could tear its group down and exit
    expect_errors(
        results, "the plan check at start-up failed", "rank(s) [1] did not reach", ranks=[0]
    )


@pytest.mark.parametrize("late", ["rebuilds", "fails-and-rebuilds"])
def test_a_caught_error_of_an_earlier_runtime_does_not_fail_the_next_plan_check(late):
    """Both ranks catch a step's error and build the runtime again, rank 0 late: rank 1
    read rank 0's old report while waiting and failed the check alone (rank 0 passed). And
    when rank 0 raised (and posted) after rank 1's next check began, its report looked new
    by its time stamp: rank 1 failed and exited, and rank 0's first send found the
    connection closed (the test's flaky failure, when the two raised in that order)."""

    def body(rank, world):
        rt, _ = runtime(rank, world, timeout_s=TIMEOUT_S)
        if rank == 0 and late != "rebuilds":
            time.sleep(1.0)  # rank 1 is in its next check by now
        with pytest.raises(ValueError, match="=None, but this rank holds"):
            rt.step(None, None)
        if rank == 0:
            time.sleep(1.5)  # rank 1 waits at the next check meanwhile
        rt, _ = runtime(rank, world, timeout_s=4 * TIMEOUT_S)
        return rt.step(*batch("mlp", 4))

    results = run_case(2, body)
    want = reference_losses(*batch("mlp", 4))
    for status, payload in results:
        assert status == "ok" and payload["error"] is None, payload
    assert [float(v) for v in results[1][1]["value"]] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("same", [True, False], ids=["same-plan", "other-plan"])
def test_plan_check_without_a_group_store_gathers_the_rows(monkeypatch, same):
    """torch without ``ProcessGroup.get_group_store``: the check falls back to an all_gather
    and still passes equal plans and refuses different ones."""
    from megatron_prt.runtime import exchange

    monkeypatch.setattr(exchange, "_group_store", lambda group: None)

    def body(rank, world):
        rt, _ = runtime(rank, world, m=4 if same or rank == 0 else 2)
        return rt.step(*batch("mlp", 4))

    results = run_case(2, body)
    if same:
        want = reference_losses(*batch("mlp", 4))
        assert [float(v) for v in results[1][1]["value"]] == pytest.approx(want, rel=1e-12)
    else:
        expect_errors(results, "ranks disagree on the plan", "(R=2 loop/uni, 2 micro-batches)")


@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_rank_killed_before_the_replica_sum_is_named(transport):
    def body(rank, world):
        rt, _ = runtime(
            rank, world, transport=transport, placement=Placement(world, 1, "loop", "bi")
        )
        rt.step(*batch("mlp", 4))
        if rank == 1:
            _die()
        rt.reduce_replica_grads()

    results = run_case(2, body, wait_for={0})
    expect_errors(results, "reduce_replica_grads failed", "[1]", ranks=[0])


@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_every_rank_of_four_names_the_failing_rank(transport):
    class Boom(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("injected failure in stage forward")

    def body(rank, world):
        rt, _ = runtime(rank, world, transport=transport)
        if rank == 0:
            rt.stages[world] = Boom()  # the rank's second stage, on its first micro-batch
        return rt.step(*batch("mlp", 4))

    results = run_case(4, body)
    expect_errors(
        results,
        "injected failure",
        **{f"r{r}": ["rank 0 failed first"] for r in (1, 2, 3)},
    )


def test_exchange_rows_of_earlier_checks_are_deleted():
    """Every check left one row per rank in the group's store for the job's whole life."""
    from megatron_prt.runtime.exchange import _PREFIX, gather_ints

    def body(rank, world):
        rows = [gather_ints([rank, call], "rows", None, 10.0) for call in range(3)]
        dist.barrier()  # every rank past its last exchange
        store = dist.group.WORLD.get_group_store()
        kept = [[store.check([f"{_PREFIX}rows/{call}/{r}"]) for r in range(world)]
                for call in (1, 2, 3)]  # fmt: skip
        return rows, kept

    for status, payload in run_case(2, body):
        assert status == "ok" and payload["error"] is None, payload
        rows, kept = payload["value"]
        assert rows == [[[0, call], [1, call]] for call in range(3)]
        assert kept == [[False, False], [False, False], [True, True]]
