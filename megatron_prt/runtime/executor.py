"""Execute a lowered plan on this rank: a dispatch table from op to handler.

Contract
--------
* ``stages`` maps every stage on this rank (pipeline 0 and, for ``bi``, pipeline 1) to an
  ``nn.Module`` taking one tensor and returning one tensor. The last stage of a pipeline
  feeds its output to ``loss_fn(output, target) -> scalar``.
* ``step(inputs, targets)`` takes per-micro-batch lists (only the entries this rank uses
  are read: inputs at first stages, targets at last stages) and returns per-micro-batch
  losses, ``None`` where another rank computed them. Gradients accumulate into the local
  stages' ``.grad`` as ``d(mean of the m losses)/d(param)``, as a non-pipelined run of the
  whole batch would give.
* Receives are posted where the lowered plan puts them (when the peer sends, ahead of need)
  and, on gloo and shared memory, up to ``recv_lookahead`` further; sends never block
  compute; only a compute action waits, and only for its own inputs.
* Same-rank hand-offs (wave turns, bi stages sharing a rank) pass tensors directly.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..core.actions import Action, Op
from ..core.lower import lower, message_key
from ..core.plan import Plan
from ..core.validate import validate
from .errors import (
    PipelineError,
    check_batch,
    clear_failure,
    collective,
    digest,
    is_wait_failure,
    pipeline_error,
    refuse_disagreement,
    root_cause,
    setting_code,
    setting_text,
)
from .memory import ActivationMeter
from .p2p import (
    ShmTransport,
    TorchTransport,
    ring_bytes,
    shm_free_bytes,
    shm_too_small,
    wire_device,
)
from .replicas import reduce_replica_grads, reduce_replica_grads_shm, replica_peers

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_TSO_MACHINES = ("x86_64", "AMD64", "i686")
_log = logging.getLogger(__name__)


class PipelineRuntime:
    """Runs ``plan``'s actions for this process's rank in the pipeline group ``group``.

    ``timeout_s`` bounds every wait for a peer (then :class:`PipelineError`);
    ``deallocate_outputs`` frees a sent activation's data (its grad_fn is kept for backward);
    ``trace`` records per-action spans (:meth:`trace`); ``transport`` is ``auto``, ``torch``
    or ``shm`` (see :mod:`megatron_prt.runtime.p2p`); ``variable_shapes``: activation shapes
    may differ between micro-batches (each message then carries its shape);
    ``measure_memory``: count the activation bytes this rank holds for backward during each
    step (:meth:`memory_stats`; the attribute may also be switched between steps).
    Construction is collective: it checks that every rank holds the same plan and sets up
    the transport.
    """

    def __init__(
        self,
        plan: Plan,
        stages: Mapping[int, torch.nn.Module],
        loss_fn: LossFn,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        timeout_s: float = 60.0,
        deallocate_outputs: bool = True,
        trace: bool = False,
        recv_lookahead: int | None = None,
        transport: str = "auto",
        shm_capacity: int = 32 << 20,
        variable_shapes: bool = False,
        measure_memory: bool = False,
    ) -> None:
        self.rank = dist.get_rank(group)
        self.plan = plan.compute_only()
        settings = {"dtype": dtype, "variable_shapes": variable_shapes}
        check_same_plan(self.plan, group, device, timeout_s, stages, settings)
        self.stages = dict(stages)
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.deallocate_outputs = deallocate_outputs
        self.trace_enabled = trace
        self.variable_shapes = variable_shapes
        self.measure_memory = measure_memory
        self._memory: ActivationMeter | None = None
        # Receives posted ahead of the plan: gloo's p2p and shared memory are fully
        # asynchronous, so posting early only moves data sooner. NCCL serialises p2p on a
        # stream, where an early receive could block a send the peer waits for: there the
        # plan's order is kept.
        if recv_lookahead is None:
            recv_lookahead = 0 if dist.get_backend(group) == "nccl" else 16
        self.recv_lookahead = recv_lookahead
        self.spans: list[tuple[Action, float, float]] = []
        self._group = group
        self._programs = {}
        for forward_only in (False, True):
            compute = self.plan.forward_only() if forward_only else self.plan
            lowered = lower(compute)
            validate(lowered)
            stream = lowered.ranks[self.rank]
            recvs = [message_key(a) for a in stream if a.op in (Op.RECV_F, Op.RECV_B)]
            self._programs[forward_only] = (lowered, _compile(stream), recvs)
        self.transport = self._make_transport(transport, shm_capacity)
        self._handlers = {
            Op.F: self._forward,
            Op.B: self._backward,
        }

    def _make_transport(self, kind: str, shm_capacity: int):
        """``torch``: torch.distributed p2p. ``shm``: shared memory between ranks on one
        host. ``auto``: shm when every rank is on this x86 host, either computes on the CPU
        or shares GPUs over gloo (which has no CUDA send/recv), and /dev/shm has room for
        the rings (else torch, with one warning line); an explicit ``shm`` without room
        raises before any segment is created (a full /dev/shm kills with SIGBUS)."""
        if kind not in ("auto", "torch", "shm"):
            raise ValueError(
                f"rank {self.rank}: transport must be auto, torch or shm, got {kind!r}"
            )
        placement = self.plan.placement
        if kind != "torch":
            rings = {r: self._shm_peers(r) for r in range(placement.ranks)}
            need = sum(len(senders) for senders, _ in rings.values()) * ring_bytes(shm_capacity)
            hosts: list = [None] * dist.get_world_size(self._group)
            with collective("the transport set-up", self._group):
                dist.all_gather_object(hosts, (socket.gethostname(), shm_free_bytes()), self._group)
            free = min(f for _, f in hosts)
            fits = need <= free
            if kind == "shm" and not fits:
                raise PipelineError(shm_too_small(self.rank, need, free, shm_capacity))
        if kind == "auto":
            # The ring publishes a message with a plain store after the copy; only x86's
            # store order makes that safe without a fence, so elsewhere auto means torch.
            staged = self.device.type == "cpu" or dist.get_backend(self._group) == "gloo"
            same_host = len({h for h, _ in hosts}) == 1 and platform.machine() in _TSO_MACHINES
            kind = "shm" if staged and same_host and fits else "torch"
            if staged and same_host and not fits and self.rank == 0:
                _log.warning(
                    "megatron_prt: /dev/shm has %d bytes free, the shared-memory rings need %d: "
                    "using the torch transport (docker run --shm-size=1g or --ipc=host gives "
                    "the faster one)",
                    free,
                    need,
                )
        if kind == "torch":
            return TorchTransport(
                self._group,
                placement.rank_of,
                self.device,
                self.dtype,
                self.timeout_s,
                self.variable_shapes,
            )
        return ShmTransport(
            self._group,
            placement.rank_of,
            rings[self.rank],
            self.timeout_s,
            shm_capacity,
            self.device,
        )

    def _shm_peers(self, rank: int) -> tuple[set[int], set[int]]:
        """The ranks ``rank`` receives from and sends to, over both programs and (``bi``) the
        replica gradient sums: one shared-memory ring per (sender, receiver)."""
        placement = self.plan.placement
        senders, receivers = set(), set()
        for lowered, _, _ in self._programs.values():
            for a in lowered.ranks[rank]:
                if a.op in (Op.RECV_F, Op.RECV_B):
                    senders.add(placement.rank_of(message_key(a)[1]))
                elif a.op in (Op.SEND_F, Op.SEND_B):
                    receivers.add(placement.rank_of(message_key(a)[2]))
        mirrors = replica_peers(placement, rank)  # bi: gradient sums go both ways
        return senders | mirrors, receivers | mirrors

    def close(self) -> None:
        """Release transport resources (shared memory); the runtime is unusable after."""
        self.transport.close()

    # -- public ----------------------------------------------------------------------------
    def step(
        self,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        forward_only: bool = False,
    ) -> list[torch.Tensor | None]:
        if getattr(self.transport, "closed", False):
            raise RuntimeError(f"rank {self.rank}: step() after close(); build a new runtime")
        placement = self.plan.placement
        for name, data, ends in (
            ("inputs", inputs, [s for s in self.stages if placement.prev_stage(s) is None]),
            ("targets", targets, [s for s in self.stages if placement.next_stage(s) is None]),
        ):
            check_batch(self.rank, name, data, ends, self.plan.num_microbatches)
        self._inputs, self._targets = inputs, targets
        self._run(forward_only)
        losses, self._losses = self._losses, None
        return losses

    def _run(self, forward_only: bool) -> None:
        """Run this rank's program once; subclasses supply the stage computations through
        :meth:`_stage_forward`, :meth:`_loss_grad` and :meth:`_stage_backward`."""
        lowered, program, self._recv_order = self._programs[forward_only]
        self._begin(forward_only)
        self._prepost()
        t0 = time.perf_counter()
        step = 0
        action: Action | None = None
        try:
            for entry in program:
                kind, step, payload = entry  # step: index in the lowered plan, for errors
                if kind == "compute":
                    action = payload
                    self._handlers[action.op](action)
                    self._prepost()
                    if self.trace_enabled:  # span: from inputs ready to compute done
                        end = time.perf_counter()
                        self.spans.append((action, self._ready_at - t0, end - t0))
                    self._reap_sends(block=False)
                else:
                    action = payload[0]
                    self._communicate(payload)
            self._reap_sends(block=True)
        except PipelineError:
            raise
        except Exception as exc:
            raise pipeline_error(
                lowered, self.rank, step, action, _describe(exc, action, self.plan)
            ) from exc

    def reduce_replica_grads(self, grad_attr: str = "grad") -> None:
        """Direction ``bi``: both replicas of every model stage end with the sum of their
        gradients (read from and written to each parameter's ``grad_attr``). Collective over
        the pipeline group; through shared memory when that is the transport, else
        torch.distributed (see :mod:`megatron_prt.runtime.replicas`)."""
        placement = self.plan.placement
        if isinstance(self.transport, ShmTransport):
            reduce_replica_grads_shm(placement, self.stages, self.transport, self.rank, grad_attr)
        else:
            reduce_replica_grads(placement, self.stages, self._group, grad_attr)

    def trace(self) -> list[tuple[Action, float, float]]:
        """Spans ``(action, start_s, end_s)`` of the last traced step, relative to its start."""
        return list(self.spans)

    def memory_stats(self) -> dict:
        """Activation memory of the last step, in bytes (see :mod:`megatron_prt.runtime.memory`
        for what counts): ``peak_bytes``, ``held_bytes`` (at the end), ``timeline`` (label of
        each compute action, bytes held after it), ``allocator_peak_bytes`` on CUDA."""
        if self._memory is None:
            raise RuntimeError("no step measured: construct with measure_memory=True and step")
        return self._memory.stats()

    def memory_peak(self) -> int:
        """Most activation bytes this rank held for backward during the last step."""
        return self.memory_stats()["peak_bytes"]

    # -- step state ------------------------------------------------------------------------
    def _begin(self, forward_only: bool) -> None:
        self._forward_only = forward_only
        self._saved_inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._received: dict[tuple, object] = {}  # key -> transport handle
        self._sends: deque = deque()  # (transport handle, tensor to free or None)
        self._losses: list[torch.Tensor | None] = [None] * self.plan.num_microbatches
        self._ready_at = 0.0
        self._next_recv = 0  # receives posted so far, in the plan's receive order
        self._plan_recvs = 0  # RECV actions the plan has reached
        self.spans = []
        self._memory = None
        if self.measure_memory:
            params = [p for module in self.stages.values() for p in module.parameters()]
            self._memory = ActivationMeter(params, self.device)

    def _take_received(self, key: tuple) -> torch.Tensor:
        return self.transport.wait(self._received.pop(key))

    def _prepost(self) -> None:
        """Keep up to ``recv_lookahead`` receives posted beyond the plan's position, in the
        plan's order (so per-peer message order is unchanged)."""
        order = self._recv_order
        posted = False
        while (
            self._next_recv < len(order)
            and len(self._received) < self.recv_lookahead
            and self.transport.knows(order[self._next_recv])
        ):
            key = order[self._next_recv]
            self._received[key] = self.transport.recv(key)
            self._next_recv += 1
            posted = True
        if posted:
            self.transport.flush()

    # -- compute handlers --------------------------------------------------------------------
    def _forward(self, action: Action) -> None:
        stage, _, mb = action
        placement = self.plan.placement
        prev = placement.prev_stage(stage)
        if prev is None:
            x = None
        else:
            if placement.rank_of(prev) == self.rank:
                x = self._outputs[(prev, mb)]
                if self._forward_only:
                    del self._outputs[(prev, mb)]
            else:
                x = self._take_received(message_key(Action(prev, Op.F, mb)))
            x = x.detach().requires_grad_(not self._forward_only)
        self._ready_at = time.perf_counter()
        with torch.set_grad_enabled(not self._forward_only), self._saving(stage, mb):
            out = self._stage_forward(stage, mb, x)
            if out is x and x is not None:
                # A stage without layers hands on its own input: give the output a grad_fn
                # of its own, so freeing the sent output's data cannot free the input and
                # its backward routes the gradient into x.grad.
                out = x.view_as(x)
        if not self._forward_only:
            self._saved_inputs[(stage, mb)] = x
        if placement.next_stage(stage) is not None or not self._forward_only:
            self._outputs[(stage, mb)] = out
        if self._memory is not None:
            self._count_kept(stage, mb, x, out)

    def _backward(self, action: Action) -> None:
        stage, _, mb = action
        placement = self.plan.placement
        out = self._outputs.pop((stage, mb))
        nxt = placement.next_stage(stage)
        if nxt is None:
            grad = self._loss_grad(stage, mb, out)
        elif placement.rank_of(nxt) == self.rank:
            grad = self._input_grads.pop((nxt, mb))
        else:
            grad = self._take_received(message_key(Action(nxt, Op.B, mb)))
        self._ready_at = time.perf_counter()
        self._stage_backward(stage, mb, out, grad)
        x = self._saved_inputs.pop((stage, mb))
        if x is not None:
            self._input_grads[(stage, mb)] = x.grad
            prev = placement.prev_stage(stage)
            if self.deallocate_outputs and placement.rank_of(prev) == self.rank:
                # A same-rank hand-off: once its consumer's backward ran, the producer's
                # output data is dead (its backward needs only the grad_fn), as for a send.
                _free_data(self._outputs[(prev, mb)])
        if self._memory is not None:
            self._memory.release((stage, mb))
            self._memory.mark(str(action))

    # -- activation memory (measure_memory) ---------------------------------------------------
    def _saving(self, stage: int, mb: int):
        """Around a stage's forward: what autograd saves is held by ``(stage, mb)``."""
        if self._memory is None or self._forward_only:
            return contextlib.nullcontext()
        return self._memory.saving((stage, mb))

    def _count_kept(self, stage: int, mb: int, x: torch.Tensor | None, out) -> None:
        """After a stage's forward: the executor keeps the input for its gradient, and an
        output until this stage's backward unless it is sent and ``deallocate_outputs``
        frees its data once sent."""
        if not self._forward_only:
            if x is not None:
                self._memory.hold((stage, mb), x)
            nxt = self.plan.placement.next_stage(stage)
            local = nxt is not None and self.plan.placement.rank_of(nxt) == self.rank
            if local and self.deallocate_outputs:  # freed by the consumer's backward
                self._memory.hold((nxt, mb), out)
            elif nxt is not None and (local or not self.deallocate_outputs):
                self._memory.hold((stage, mb), out)
        self._memory.mark(f"{stage}F{mb}")

    # -- what a stage computes (overridden by the megatron-core integration) -------------------
    def _stage_forward(self, stage: int, mb: int, x: torch.Tensor | None) -> torch.Tensor:
        """Stage output for ``mb`` (``x`` is None at a first stage); at a last stage the loss."""
        if x is None:
            x = self._inputs[mb].to(self.device)
        out = self.stages[stage](x)
        if self.plan.placement.next_stage(stage) is None:
            out = self.loss_fn(out, self._targets[mb].to(self.device))
            self._losses[mb] = out.detach()
        return out

    def _loss_grad(self, stage: int, mb: int, loss: torch.Tensor) -> torch.Tensor | None:
        """Gradient that seeds a last stage's backward: the mean over micro-batches."""
        return torch.full_like(loss, 1.0 / self.plan.num_microbatches)

    def _stage_backward(
        self, stage: int, mb: int, out: torch.Tensor, grad: torch.Tensor | None
    ) -> None:
        run_backward(out, grad)

    # -- communication -----------------------------------------------------------------------
    def _communicate(self, actions: list[Action]) -> None:
        for action in actions:
            key = message_key(action)
            if action.op is Op.SEND_F:
                where = (action.stage, action.mb)
                out = self._outputs.pop(where) if self._forward_only else self._outputs[where]
                free = out if self.deallocate_outputs and not self._forward_only else None
                self._sends.append((self.transport.send(key, out), free))
            elif action.op is Op.SEND_B:
                grad = self._input_grads.pop((action.stage, action.mb))
                self._sends.append((self.transport.send(key, grad), None))
            else:
                self._plan_recvs += 1
                if self._plan_recvs <= self._next_recv:  # already posted ahead
                    continue
                self._received[key] = self.transport.recv(key)
                self._next_recv += 1
        self.transport.flush()

    def _reap_sends(self, block: bool) -> None:
        while self._sends:
            handle, free = self._sends[0]
            if block:
                self.transport.wait(handle)
            elif not self.transport.is_completed(handle):
                return
            self._sends.popleft()
            if free is not None:
                _free_data(free)


_DEAD: dict[tuple, torch.Tensor] = {}  # one shared placeholder per (device, dtype)


def _free_data(out: torch.Tensor) -> None:
    """Megatron's trick: a handed-on output's data is not needed for its backward (autograd
    holds what it saved), only its grad_fn; drop the storage. Every freed output points at
    one shared 1-element placeholder, never read."""
    if out.grad_fn is None:  # outside autograd (a first stage without layers hands on the
        return  # caller's input): nothing needs its grad_fn, and the data is not ours to free
    key = (out.device, out.dtype)
    if key not in _DEAD:
        _DEAD[key] = torch.empty((1,), device=out.device, dtype=out.dtype)
    out.data = _DEAD[key]


def run_backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward from ``out`` whose data may have been freed (shape then differs from grad);
    ``grad`` None: ``out`` is a scalar loss."""
    if not out.requires_grad:  # a first stage without parameters: nothing to differentiate
        return
    if grad is None:
        grad = torch.ones_like(out)
    if out.shape == grad.shape:
        torch.autograd.backward(out, grad)
    else:
        Variable._execution_engine.run_backward((out,), (grad,), False, False, (), True, True)


def _compile(stream: Sequence[Action]) -> list[tuple[str, int, object]]:
    """Group consecutive comm actions into one batch; compute actions stand alone."""
    program: list[tuple[str, int, object]] = []
    for step, action in enumerate(stream):
        if action.op.is_compute:
            program.append(("compute", step, action))
        elif program and program[-1][0] == "comm":
            program[-1][2].append(action)
        else:
            program.append(("comm", step, [action]))
    return program


def _describe(exc: Exception, action: Action | None, plan: Plan) -> str:
    """The reason for the error text; a failed wait on a peer names the root cause the other
    ranks posted (:mod:`megatron_prt.runtime.errors`), else the rank waited on."""
    text = f"{type(exc).__name__}: {exc}".strip()
    if not is_wait_failure(exc):
        return text
    cause = root_cause(None, name_silent=False)
    if cause:
        return f"{cause}\n  this rank saw: {text}"
    if action is None:
        return text
    placement = plan.placement
    peer = None
    if action.op is Op.F and placement.prev_stage(action.stage) is not None:
        peer = placement.rank_of(placement.prev_stage(action.stage))
    elif action.op is Op.B and placement.next_stage(action.stage) is not None:
        peer = placement.rank_of(placement.next_stage(action.stage))
    elif not action.op.is_compute:
        _, src, dst, _ = message_key(action)
        peer = placement.rank_of(dst if action.op in (Op.SEND_F, Op.SEND_B) else src)
    if peer is not None:
        text += f" (waiting on rank {peer}: it may have failed or be stuck)"
    return text


def check_same_plan(
    plan: Plan,
    group,
    device: torch.device,
    timeout_s: float,
    stages: Mapping[int, torch.nn.Module] | None = None,
    settings: Mapping[str, object] | None = None,
) -> None:
    """Refuse to start unless the group has the plan's P ranks (checked locally, before any
    communication), every rank was given the stages the plan places there, and every rank
    holds the same plan and the same ``settings`` (e.g. ``dtype``): one all_gather of hashes,
    after which every rank raises, naming the ranks that differ."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    placement = plan.placement
    if world != placement.ranks:
        raise PipelineError(
            f"rank {rank}: the plan is for P = {placement.ranks} pipeline ranks, the group has "
            f"{world}; build the plan for Placement({world}, ...) or pass group= a group of "
            f"{placement.ranks} ranks"
        )
    if not timeout_s > 0:  # also refuses NaN
        raise ValueError(f"rank {rank}: timeout_s={timeout_s!r}; pass a positive number of seconds")
    clear_failure()  # a report of an earlier runtime in this job is not this one's
    settings = dict(settings or {})
    expected = sorted(placement.rank_stages[rank])
    given = None if stages is None else sorted(stages)
    values = [digest(plan.fingerprint()), int(given not in (None, expected))]
    values += [setting_code(v) for v in settings.values()]
    mine = torch.tensor(values, dtype=torch.int64, device=wire_device(group, device))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    with collective("the plan check at start-up", group):
        work = dist.all_gather(gathered, mine, group=group, async_op=True)
        work.wait(timedelta(seconds=timeout_s))
    rows = [[int(v) for v in t] for t in gathered]
    if given not in (None, expected):
        raise ValueError(f"rank {rank}: stages {given} given, the plan places {expected} here")
    wrong = [r for r, row in enumerate(rows) if row[1]]
    if wrong:
        raise PipelineError(
            f"rank {rank}: rank(s) {wrong} were given other stages than the plan places there "
            "(see their errors); pass each rank the stages of build_stages(plan.placement, rank, "
            "...)"
        )
    columns = {"plan": 0, **{name: 2 + i for i, name in enumerate(settings)}}
    for name, column in columns.items():
        show = (lambda code: f"{code:016x}") if name == "plan" else setting_text
        refuse_disagreement(rank, name, [row[column] for row in rows], show)
