"""Execute a lowered plan on this rank: a dispatch table from op to handler.

Every action of the rank's lowered plan, compute (``F``, ``B``) and communication
(``SEND_F``, ``SEND_B``, ``RECV_F``, ``RECV_B``), has one handler. The program is compiled
once per runtime: each action is bound to its handler and to what it reads and writes,
found through the dependency rule (:mod:`megatron_prt.core.deps`: which action produced an
input, on which stage and rank) and :func:`megatron_prt.core.lower.message_key`, so a step
only indexes dictionaries. What a stage computes is a :class:`StageCallbacks` object
(:mod:`megatron_prt.runtime.callbacks`). Split backward: ``I`` takes ``B``'s inputs and
leaves its input-gradient for ``SEND_B`` or the same-rank consumer exactly as ``B`` does,
through the callbacks' ``input_grad``; ``W`` runs ``weight_grad`` (the deferred weight
GEMMs, :mod:`megatron_prt.runtime.wgrad`) and reads nothing from other stages.

Contract
--------
* ``stages`` maps every stage on this rank (pipeline 0 and, for ``bi``, pipeline 1) to an
  ``nn.Module``; by default (:class:`ModuleCallbacks`) each takes one tensor and returns
  one tensor, and the last stage of a pipeline feeds its output to
  ``loss_fn(output, target) -> scalar``. ``callbacks`` replaces that computation (the
  megatron-core integration passes its own).
* ``step(inputs, targets)`` takes per-micro-batch lists (only the entries this rank uses
  are read: inputs at first stages, targets at last stages) and returns per-micro-batch
  losses, ``None`` where another rank computed them. Gradients accumulate into the local
  stages' ``.grad`` as ``d(mean of the m losses)/d(param)``, as a non-pipelined run of the
  whole batch would give.
* Receives are posted where the lowered plan puts them (when the peer sends, ahead of need),
  on NCCL one compute earlier where that stays deadlock-free (``early_recvs``), and, on
  gloo and shared memory, up to ``recv_lookahead`` further; sends never block
  compute; only a compute action waits, and only for its own inputs.
* Same-rank hand-offs (wave turns, bi stages sharing a rank) pass tensors directly.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ..core.actions import Action, Op
from ..core.deps import carries_tensor, consumers, producers
from ..core.lower import lower, message_ends, message_key
from ..core.plan import Plan
from ..core.validate import validate
from . import messages
from .callbacks import LossFn, StageCallbacks, module_callbacks
from .errors import (
    PipelineError,
    check_same_step,
    pipeline_error,
    rank_label,
    refuse_after_failure,
    why_failed,
)
from .memory import ActivationMeter
from .messages import check_activation, step_stamp, synced_clock
from .ordered import EARLY_RECVS_AUTO, post_recvs_early
from .p2p import ShmTransport, TorchTransport
from .program import Compute, free_data, is_recv
from .replicas import BufferWatch, reduce_replica_grads, reduce_replica_grads_shm, replica_params
from .rings import make_transport, sized_shm
from .split_plan import split_backward_plan
from .startup import check_same_plan
from .wgrad import split_backward_pass, split_forward

_NO_CONTEXT = contextlib.nullcontext()  # reusable


class PipelineRuntime:
    """Runs ``plan``'s actions for this process's rank in the pipeline group ``group``.

    ``dtype``: the dtype of every stage output (activation) and so of every message between
    stages, on every transport (an output of another dtype stops the step naming it);
    ``timeout_s`` bounds every wait for a peer (then :class:`PipelineError`);
    ``deallocate_outputs`` frees a sent activation's data (its grad_fn is kept for backward);
    ``trace`` records per-action spans (:meth:`trace`); ``transport`` is ``auto``, ``torch``
    or ``shm`` (see :mod:`megatron_prt.runtime.p2p`); shared-memory rings are sized from the
    first step's messages, which go over torch.distributed, or are ``shm_capacity`` bytes
    each when given (:mod:`megatron_prt.runtime.rings`); ``variable_shapes``: activation shapes
    may differ between micro-batches (each message then carries its shape; on shared memory
    pass ``shm_capacity`` for the largest, else a later message larger than the first
    step's stops the step naming ``shm_capacity``);
    ``measure_memory``: count the activation bytes this rank holds for backward during each
    step (:meth:`memory_stats`; the attribute may also be switched between steps);
    ``callbacks``: what the stages compute (default :class:`ModuleCallbacks` over ``stages``
    and ``loss_fn``, which may be None when ``callbacks`` is given); ``split_backward``: run
    each ``B`` of ``plan`` as ``I`` then ``W`` (a plan with ``I``/``W`` runs split as given);
    with the default callbacks a split plan makes the stages' ``nn.Linear`` layers
    split-capable (:func:`megatron_prt.runtime.wgrad.enable_split_backward`); ``early_recvs``
    (default: on NCCL without ``variable_shapes``, for plans of at most ``EARLY_RECVS_AUTO``
    messages, beyond which the pass takes seconds): once every edge's shape is known, run
    the plan with each receive posted as early as NCCL's ordering allows
    (:mod:`megatron_prt.runtime.ordered`), so its transfer overlaps the compute before it.
    Construction is
    collective: it checks that every rank holds the same plan and sets up the transport.
    ``__init__`` is long because it stores its options in order, each with the reason it has;
    the work it does is in ``check_same_plan``, ``_compile`` and ``make_transport``.
    """

    def __init__(
        self,
        plan: Plan,
        stages: Mapping[int, torch.nn.Module],
        loss_fn: LossFn | None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        timeout_s: float = 60.0,
        deallocate_outputs: bool = True,
        trace: bool = False,
        recv_lookahead: int | None = None,
        transport: str = "auto",
        shm_capacity: int | None = None,
        variable_shapes: bool = False,
        measure_memory: bool = False,
        callbacks: StageCallbacks | None = None,
        split_backward: bool = False,
        early_recvs: bool | None = None,
    ) -> None:
        self.rank = dist.get_rank(group)
        self.who = rank_label(self.rank, group)  # what errors call this rank
        if split_backward:
            plan = split_backward_plan(plan)
        self.plan = plan.compute_only()
        if not self.plan.has_backward:  # step() would train with zero gradients
            raise ValueError(
                f"{self.who}: the plan has no backward (no B, nor I and W); give the "
                "training plan (build_plan, load_plan): step(forward_only=True) runs its "
                "forwards alone"
            )
        settings = {
            "dtype": dtype,
            "variable_shapes": variable_shapes,
            "transport": transport,  # ranks on different transports would wait forever
            "shm_capacity": shm_capacity,
        }
        check_same_plan(self.plan, group, device, timeout_s, stages, settings)
        self.stages = dict(stages)
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        self.dtype = dtype
        self.timeout_s = timeout_s
        self._summed_attr: str | None = None  # see [Note: replica sums accumulate]
        self.deallocate_outputs = deallocate_outputs
        self.trace_enabled = trace
        self.variable_shapes = variable_shapes
        self.measure_memory = measure_memory
        self.callbacks = callbacks or module_callbacks(
            self.stages, loss_fn, self.plan, self.device, self.rank, self.who
        )
        self._buffers = BufferWatch.of(plan.placement, self.stages)  # bi: says drifting ones
        self._steps_begun, self._failed = 0, None  # see [Note: every message carries its step]
        self._memory: ActivationMeter | None = None
        # Receives posted ahead of the plan: gloo's p2p and shared memory are fully
        # asynchronous, so posting early only moves data sooner. NCCL serialises p2p on a
        # stream, where an early receive could block a send the peer waits for: there
        # receives move only where runtime.ordered proves it safe (early_recvs).
        if recv_lookahead is None:
            recv_lookahead = 0 if dist.get_backend(group) == "nccl" else 16
        self.recv_lookahead = recv_lookahead
        self.spans: list[tuple[Action, float, float]] = []
        self._group = group
        self._split = self.plan.split_backward
        self._compute_handlers = {
            Op.F: self._forward,
            Op.B: self._backward,
            Op.I: self._backward,
            Op.W: self._weight_grad,
        }
        self._comm_handlers = {
            Op.SEND_F: self._send_output,
            Op.SEND_B: self._send_input_grad,
            Op.RECV_F: self._post_recv,
            Op.RECV_B: self._post_recv,
        }
        auto = early_recvs is None and dist.get_backend(group) == "nccl" and not variable_shapes
        self._compile_programs(bool(early_recvs), auto)
        self.transport, self._sizing = make_transport(self, transport, shm_capacity)

    def _compile_programs(self, early_recvs: bool, auto: bool) -> None:
        """This rank's lowered, validated program for training and for forward-only steps;
        with ``early_recvs``, or ``auto`` (NCCL's default) up to :data:`EARLY_RECVS_AUTO`
        messages (the cost of the pass), also the order that posts receives early."""
        self._programs, self._early = {}, {}
        for forward_only in (False, True):
            compute = self.plan.forward_only() if forward_only else self.plan
            lowered = lower(compute)
            validate(lowered)
            self._programs[forward_only] = (lowered, *self._compile(lowered.ranks[self.rank]))
            messages = sum(not a.op.is_compute for stream in lowered.ranks for a in stream)
            if early_recvs or (auto and messages <= EARLY_RECVS_AUTO):
                # the plan's own order runs until every edge's shape is exchanged
                early = post_recvs_early(lowered)
                self._early[forward_only] = (early, *self._compile(early.ranks[self.rank]))

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
        """Run one iteration: forward and backward of every micro-batch (forward alone with
        ``forward_only``). ``inputs`` are the m micro-batches' inputs, needed on ranks holding a
        first stage (None elsewhere); ``targets`` likewise where a last stage sits. Returns m
        entries: micro-batch ``mb``'s detached loss on the rank holding its last stage (under
        ``bi`` that rank depends on ``mb``'s direction), None on every other rank. Gradients
        accumulate into the stages' parameters, scaled as for the mean loss over the m. A
        stage whose output does not depend on its input (it detaches it) hands the stages
        before a zero gradient: their parameters get zeros where the unpipelined model
        leaves ``None`` (the same update for an optimizer without weight decay)."""
        self._refuse_after_close("step()")
        refuse_after_failure(self._failed, self.who, "step()")
        self.callbacks.begin(inputs, targets, forward_only)
        if not forward_only and self._summed_attr is not None:
            self._restart_replica_sums()
        watch, self._buffers = (None, self._buffers) if forward_only else (self._buffers, None)
        if watch is not None:  # the first training step's changes to bi buffers
            watch.begin()
        self.transport.stamp = step_stamp(self._steps_begun, forward_only)
        self._steps_begun += 1
        ignored = dist.get_backend(self._group) in messages.TAGS_IGNORED_BY
        if ignored and isinstance(self.transport, TorchTransport):
            check_same_step(
                self.transport.stamp, self._group, self.device, self.who, self.timeout_s
            )
        self._run(forward_only)
        if watch is not None:
            watch.check()
        losses, self._losses = self._losses, None
        self._size_rings()  # the messages are known now
        return losses

    def _size_rings(self) -> None:
        """Build the shared-memory rings once, after the first step (or before the first
        replica sum); see :mod:`megatron_prt.runtime.rings`. Collective."""
        if self._sizing is not None:
            stamp = self.transport.stamp
            self.transport, self._sizing = sized_shm(self, self._sizing), None
            self.transport.stamp = stamp

    def _run(self, forward_only: bool) -> None:
        """Run this rank's program once: each entry's handler on its precomputed operand."""
        lowered, program, self._recv_order = self._programs[forward_only]
        if forward_only in self._early and all(map(self.transport.knows, self._recv_order)):
            lowered, program, self._recv_order = self._early[forward_only]
        self._begin(forward_only)
        t0 = time.perf_counter()
        step = 0  # index in the lowered plan, for errors
        action: Action | None = None
        try:
            for step, action, handler, operand, is_compute in program:  # noqa: B007 (errors)
                handler(operand)
                if is_compute:
                    if self.trace_enabled:  # span: from inputs ready to compute done
                        end = self._clock()
                        self.spans.append((action, self._ready_at - t0, end - t0))
                    self._reap_sends(block=False)
            self._reap_sends(block=True)
        except Exception as exc:
            self._failed = f"{type(exc).__name__} at step index {step}"
            if isinstance(exc, PipelineError):
                raise
            raise pipeline_error(
                lowered,
                self.rank,
                step,
                action,
                why_failed(exc, action, self.plan, self._group),
                self.who,
            ) from exc

    def _refuse_after_close(self, call: str) -> None:
        if getattr(self.transport, "closed", False):
            raise RuntimeError(f"{self.who}: {call} after close(); build a new runtime")

    def reduce_replica_grads(self, grad_attr: str = "grad") -> None:
        """Direction ``bi``: both replicas of every model stage end with the sum of their
        gradients (read from and written to each parameter's ``grad_attr``) accumulated
        since they were zeroed: call it once before the optimizer step, or after every
        :meth:`step` of an accumulation ([Note: replica sums accumulate]). Collective over
        the pipeline group; through shared memory when that is the transport, else
        torch.distributed (see :mod:`megatron_prt.runtime.replicas`)."""
        if self._summed_attr == grad_attr:  # no training step since the last sum
            return
        self._refuse_after_close("reduce_replica_grads()")  # its rings are gone (a KeyError)
        refuse_after_failure(self._failed, self.who, "reduce_replica_grads()")
        placement = self.plan.placement
        self._size_rings()
        if isinstance(self.transport, ShmTransport):
            reduce_replica_grads_shm(placement, self.stages, self.transport, self.rank, grad_attr)
        else:
            reduce_replica_grads(
                placement, self.stages, self._group, grad_attr, timeout_s=self.timeout_s
            )
        self._summed_attr = grad_attr if placement.direction == "bi" else None

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The pipeline's process group (None: the default group), as constructed."""
        return self._group

    @property
    def summed_replicas(self) -> str | None:
        """The gradient attribute whose replicas were summed with no training step since,
        or None ([Note: replica sums accumulate])."""
        return self._summed_attr

    def gradients_restored(self, summed: str | None = None) -> None:
        """The caller put back gradients of its own (a timing of the sum restores them after
        each sum): ``summed`` names the attribute whose restored gradients are already
        summed, as :attr:`summed_replicas` gave it; None, the next sum sums them."""
        self._summed_attr = summed

    # [Note: replica sums accumulate] After a sum both replicas hold S, the gradients so far.
    # A step of an accumulation adds g0 to the first replica and g1 to the second; summing
    # again would give 2S + g0 + g1. So the first training step after a sum zeroes the second
    # replicas (pipeline 1's stages, ids D..2D-1), and the next sum gives S + g0 + g1, as one
    # sum after every step would; a sum with no training step since returns at once.
    def _restart_replica_sums(self) -> None:
        attr, depth = self._summed_attr, self.plan.placement.depth
        self._summed_attr = None
        with torch.no_grad():  # each summed parameter once: a tie may span the pipelines
            for stage, params in replica_params(self.plan.placement, self.stages).items():
                for param in params if stage >= depth else ():
                    grad = getattr(param, attr, None)
                    if grad is not None:
                        grad.zero_()

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

    # -- the program: each action bound to its handler and operands, once ----------------
    def _compile(self, stream: Sequence[Action]) -> tuple[list[tuple], list[tuple]]:
        """This rank's program and the message keys of its receives, in plan order.

        Program entries are ``(step, action, handler, operand, is_compute)``: one per compute
        action, and one per run of consecutive comm actions (issued together, then flushed:
        one batch on NCCL), whose operand lists ``(handler, message key, (stage, mb))``."""
        placement, split = self.plan.placement, self._split
        program: list[tuple] = []
        recvs: list[tuple] = []
        for step, action in enumerate(stream):
            if action.op.is_compute:
                handler = self._compute_handlers[action.op]
                program.append((step, action, handler, self._operand(action), True))
                continue
            producer, consumer = message_ends(action, placement, split)
            key = message_key(producer, consumer)
            if is_recv(action):
                recvs.append(key)
            entry = (self._comm_handlers[action.op], key, (producer.stage, producer.mb))
            if program and not program[-1][4]:
                program[-1][3].append(entry)
            else:
                program.append((step, action, self._communicate, [entry], False))
        return program, recvs

    def _operand(self, action: Action) -> Compute:
        """What a compute action reads and keeps, from the dependency rule."""
        placement, split = self.plan.placement, self._split
        feeds = [c for c in consumers(action, placement, split) if carries_tensor(action, c)]
        local_next = [c.stage for c in feeds if placement.rank_of(c.stage) == self.rank]
        return Compute(
            action,
            *self._tensor_in(action),
            local_next=local_next[0] if local_next else None,
            is_loss=action.op is Op.F and not feeds,
            input_from=self._tensor_in(Action(action.stage, Op.F, action.mb))[0],
        )

    def _tensor_in(self, action: Action) -> tuple[tuple | None, tuple | None]:
        """Where ``action``'s tensor input comes from: ``((stage, mb) of its producer, None)``
        on this rank, ``(None, message key)`` from another rank, ``(None, None)`` for none
        (a pipeline's first F, its last B: the loss)."""
        placement = self.plan.placement
        fed = [p for p in producers(action, placement, self._split) if carries_tensor(p, action)]
        if not fed:
            return None, None
        (producer,) = fed  # one tensor input per action: see megatron_prt.core.deps
        if placement.rank_of(producer.stage) == self.rank:
            return (producer.stage, producer.mb), None
        return None, message_key(producer, action)

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
        # a traced step's span ends on CUDA wait for the device: kernels run asynchronously,
        # so an unsynchronized span is their launch (a large GEMM priced at a launch or two)
        synced = self.trace_enabled and self.device.type == "cuda"
        self._clock = functools.partial(synced_clock, self.device) if synced else time.perf_counter
        self._next_recv = 0  # receives posted so far, in the plan's receive order
        self._plan_recvs = 0  # RECV actions the plan has reached
        self.spans = []
        self._memory = None
        if self.measure_memory:
            params = [p for module in self.stages.values() for p in module.parameters()]
            self._memory = ActivationMeter(params, self.device)

    def _take_received(self, key: tuple) -> torch.Tensor:
        self._prepost()  # before this rank blocks, so that peers can send it what follows
        return self.transport.wait(self._received.pop(key))

    def _prepost(self) -> None:
        """Keep up to ``recv_lookahead`` receives posted beyond the plan's position, in the
        plan's order (so per-peer message order is unchanged). Called after each group of
        comm actions, behind its sends, and before each wait for a message: never ahead of
        the sends a compute produced (they are on a peer's critical path, the receives
        rarely are), nor ahead of a step's first compute when it needs no message."""
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
    def _forward(self, op: Compute) -> None:
        forward_only = self._forward_only
        if op.local_in is not None:
            held = self._outputs
            x = held.pop(op.local_in) if forward_only else held[op.local_in]
        elif op.remote_in is not None:
            x = self._take_received(op.remote_in)
        else:
            x = None
        if x is not None:
            x = x.detach().requires_grad_(not forward_only)
        self._ready_at = self._clock()
        # the common case opens no split context (generator context managers cost a few
        # calls each, on every action)
        splitting = split_forward() if self._split and not forward_only else _NO_CONTEXT
        with torch.set_grad_enabled(not forward_only), self._saving(op.where), splitting:
            out = self.callbacks.forward(op.stage, op.mb, x)
            if out is x and x is not None:
                # A stage without layers hands on its own input: give the output a grad_fn
                # of its own, so freeing the sent output's data cannot free the input and
                # its backward routes the gradient into x.grad.
                out = x.view_as(x)
        if op.is_loss:
            self._losses[op.mb] = out.detach()
        else:
            check_activation(op.stage, op.mb, out, self.dtype, training=not forward_only)
        if not forward_only:
            self._saved_inputs[op.where] = x
            self._outputs[op.where] = out
        elif not op.is_loss:
            self._outputs[op.where] = out
        if self._memory is not None:
            self._count_kept(op, x, out)

    def _backward(self, op: Compute) -> None:
        """B, or I (split backward): the same inputs, the same input-gradient left behind."""
        out = self._outputs.pop(op.where)
        if op.local_in is not None:
            grad = self._input_grads.pop(op.local_in)
        elif op.remote_in is not None:
            grad = self._take_received(op.remote_in)
        else:
            grad = self.callbacks.loss_grad(op.stage, op.mb, out)
        self._ready_at = self._clock()
        split = op.action.op is Op.I
        # a recomputation in here takes its forward's form ([Note: recompute sees the
        # forward's form] in wgrad.py)
        with split_backward_pass() if self._split else _NO_CONTEXT:
            if split:
                self.callbacks.input_grad(op.stage, op.mb, out, grad)
            else:
                self.callbacks.backward(op.stage, op.mb, out, grad)
        x = self._saved_inputs.pop(op.where)
        if x is not None:
            # no gradient reached the input (the stage detaches or ignores it): the layers
            # before get a zero gradient, not a backward seeded as for a loss
            self._input_grads[op.where] = torch.zeros_like(x) if x.grad is None else x.grad
            if self.deallocate_outputs and op.input_from is not None:
                # A same-rank hand-off: once its consumer's backward ran, the producer's
                # output data is dead (its backward needs only the grad_fn), as for a send.
                free_data(self._outputs[op.input_from])
        if self._memory is not None:
            self._memory.release(op.where)
            if split:  # what W needs stays held until it runs
                for tensor in self.callbacks.held_for_weight_grad(op.stage, op.mb):
                    self._memory.hold(op.where, tensor)
            self._memory.mark(str(op.action))

    def _weight_grad(self, op: Compute) -> None:
        """W: the weight gradients the stage's I deferred; no tensor in or out."""
        self._ready_at = self._clock()
        self.callbacks.weight_grad(op.stage, op.mb)
        if self._memory is not None:
            self._memory.release(op.where)
            self._memory.mark(str(op.action))

    # -- activation memory (measure_memory) ---------------------------------------------------
    def _saving(self, where: tuple[int, int]):
        """Around a stage's forward: what autograd saves is held by ``(stage, mb)``."""
        if self._memory is None or self._forward_only:
            return _NO_CONTEXT
        return self._memory.saving(where)

    def _count_kept(self, op: Compute, x: torch.Tensor | None, out) -> None:
        """After a stage's forward: the executor keeps the input for its gradient, and an
        output until this stage's backward unless it is sent and ``deallocate_outputs``
        frees its data once sent."""
        if not self._forward_only:
            if x is not None:
                self._memory.hold(op.where, x)
            local = op.local_next is not None
            if local and self.deallocate_outputs:  # freed by the consumer's backward
                self._memory.hold((op.local_next, op.mb), out)
            elif not op.is_loss and (local or not self.deallocate_outputs):
                self._memory.hold(op.where, out)
        self._memory.mark(str(op.action))

    # -- communication handlers ------------------------------------------------------------
    def _communicate(self, batch: list[tuple]) -> None:
        for handler, key, where in batch:
            handler(key, where)
        self._prepost()
        self.transport.flush()

    def _send_output(self, key: tuple, where: tuple[int, int]) -> None:
        """SEND_F: the activation ``where`` = (stage, mb) computed."""
        if self._forward_only:
            out, free = self._outputs.pop(where), None
        else:
            out = self._outputs[where]
            free = out if self.deallocate_outputs else None
        self._sends.append((self.transport.send(key, out), free))

    def _send_input_grad(self, key: tuple, where: tuple[int, int]) -> None:
        """SEND_B: the input-gradient the backward of ``where`` left (B's, or I's)."""
        self._sends.append((self.transport.send(key, self._input_grads.pop(where)), None))

    def _post_recv(self, key: tuple, where: tuple[int, int]) -> None:
        """RECV_F / RECV_B: post the receive, unless :meth:`_prepost` already did."""
        self._plan_recvs += 1
        if self._plan_recvs <= self._next_recv:  # already posted ahead
            return
        self._received[key] = self.transport.recv(key)
        self._next_recv += 1

    def _reap_sends(self, block: bool) -> None:
        while self._sends:
            handle, free = self._sends[0]
            if block:
                self.transport.wait(handle)
            elif not self.transport.is_completed(handle):
                return
            self._sends.popleft()
            if free is not None:
                free_data(free)
