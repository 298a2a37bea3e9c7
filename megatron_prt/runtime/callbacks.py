"""What a stage computes, as one object the executor calls: :class:`StageCallbacks`.

The executor (:mod:`megatron_prt.runtime.executor`) decides *when* each action runs and
moves tensors between stages; the callbacks decide *what* a stage computes. The executor
calls, on the rank that owns ``stage``:

* ``begin(inputs, targets, forward_only)`` once at the start of every step, with the
  arguments of :meth:`PipelineRuntime.step`;
* ``forward(stage, mb, x)`` for ``F``: ``x`` is the stage input (``None`` at a pipeline's
  first stage, where the callbacks supply the micro-batch themselves), already detached
  and requiring grad unless ``forward_only``; it runs under ``torch.set_grad_enabled(not
  forward_only)``. Returns the stage output, or at a pipeline's last stage the loss, which
  :meth:`PipelineRuntime.step` returns for that micro-batch;
* ``loss_grad(stage, mb, loss)`` at a last stage before its backward: the gradient that
  seeds it, or ``None`` for a scalar loss that is seeded with one;
* ``backward(stage, mb, out, grad)`` for ``B``: accumulate parameter gradients and the
  input's ``.grad`` from ``out`` (the forward's return value, whose data may have been
  freed once sent: use :func:`run_backward`) and ``grad`` (from ``loss_grad`` or the next
  stage).

* split backward (``I`` then ``W``): ``input_grad(stage, mb, out, grad)`` for ``I`` takes
  ``backward``'s arguments and leaves the input's ``.grad`` as ``backward`` does, deferring
  the weight gradients of split-capable layers (:mod:`megatron_prt.runtime.wgrad`);
  ``weight_grad(stage, mb)`` for ``W`` computes them; ``held_for_weight_grad(stage, mb)``
  lists the tensors kept between the two (for the memory meter). The defaults run
  ``backward`` inside :func:`~megatron_prt.runtime.wgrad.deferring_weight_grads` and keep
  the deferred work per (stage, mb), so an override of ``backward`` splits too; parameters
  outside split-capable layers get their gradients in ``I``.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.autograd import Variable

from ..core.placement import Placement
from ..core.plan import Plan, split_microbatches
from .errors import check_batch, post_failure
from .wgrad import (
    WeightGradWork,
    apply_weight_grads,
    deferring_weight_grads,
    enable_split_backward,
    held_tensors,
)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StageCallbacks:
    """Base class of stage computations (see the module docstring for the contract).
    ``in_place_weight_grads``: W adds into ``.grad`` directly where it already holds a
    gradient (see :func:`~megatron_prt.runtime.wgrad.apply_weight_grads`); only where no
    hook sits on the parameters' gradient accumulators (megatron's DDP puts one there)."""

    in_place_weight_grads = False

    def begin(
        self,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        forward_only: bool,
    ) -> None:
        """Start of a step; the default keeps nothing."""

    def forward(self, stage: int, mb: int, x: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.forward (stage {stage}, mb {mb})")

    def loss_grad(self, stage: int, mb: int, loss: torch.Tensor) -> torch.Tensor | None:
        return None

    def backward(self, stage: int, mb: int, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        run_backward(out, grad)

    def input_grad(self, stage: int, mb: int, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        with deferring_weight_grads() as work:
            self.backward(stage, mb, out, grad)
        _deferred(self)[(stage, mb)] = work

    def weight_grad(self, stage: int, mb: int) -> None:
        work = _deferred(self).pop((stage, mb), None)
        if work is None:
            raise RuntimeError(f"stage {stage}, mb {mb}: W ran before its I (input_grad)")
        apply_weight_grads(work, in_place=self.in_place_weight_grads)

    def held_for_weight_grad(self, stage: int, mb: int) -> list[torch.Tensor]:
        return held_tensors(self.deferred_weight_grads(stage, mb))

    def deferred_weight_grads(self, stage: int, mb: int) -> list[WeightGradWork]:
        """The work ``input_grad`` of (stage, mb) deferred to ``weight_grad`` (empty: none)."""
        return list(_deferred(self).get((stage, mb), ()))


def _deferred(callbacks: StageCallbacks) -> dict[tuple[int, int], list[WeightGradWork]]:
    """The weight-gradient work ``callbacks`` deferred, by (stage, mb), kept on the object
    (subclasses need not call a base ``__init__``)."""
    return callbacks.__dict__.setdefault("_weight_grad_work", {})


class ModuleCallbacks(StageCallbacks):
    """The plain-PyTorch stages: ``stages[stage]`` is an ``nn.Module`` taking one tensor and
    returning one; a first stage reads ``inputs[mb]``, a last stage returns
    ``loss_fn(output, targets[mb])`` and seeds its backward with ``1/m``, so gradients are
    those of the mean loss over the ``num_microbatches`` micro-batches. W writes weight
    gradients in place; a hook put on a parameter's gradient accumulator node itself (as
    Horovod's and DeepSpeed's are) is invisible from Python and would not fire: such stages
    take a subclass with ``in_place_weight_grads = False``."""

    in_place_weight_grads = True  # the runtime's own stages: no accumulator hooks ...

    def __init__(
        self,
        stages: Mapping[int, torch.nn.Module],
        loss_fn: LossFn,
        placement: Placement,
        num_microbatches: int,
        device: torch.device,
        rank: int,
        who: str | None = None,
    ) -> None:
        self.stages = stages
        # ... unless a stage wraps its module in torch's DDP or FSDP, whose reducers hook the
        # accumulators from C++, out of sight of apply_weight_grads' own check: written in
        # place, the weight gradients were never reduced across data-parallel ranks
        in_place = type(self).in_place_weight_grads  # a subclass may turn it off
        self.in_place_weight_grads = in_place and not any(map(_reduces_gradients, stages.values()))
        self.rank = rank
        self.who = who or f"rank {rank}"  # how messages name it (errors.rank_label)
        self.loss_fn = loss_fn
        self.placement = placement
        self.num_microbatches = num_microbatches
        self.device = device
        self.inputs: Sequence[torch.Tensor] | None = None
        self.targets: Sequence[torch.Tensor] | None = None
        self.training = True  # the step's: begin() sets it
        self.mb_pipeline: Sequence[int] = ()  # the plan's (module_callbacks); () the default

    def begin(self, inputs, targets, forward_only) -> None:
        """Refuses (naming the argument, the rank and the fix) a batch this rank cannot read:
        not one tensor per micro-batch where its first stages read inputs or its last stages
        read targets; and a training step whose DDP stage would reduce too early
        (:func:`reducing_too_early`)."""
        for name, data, ends in (
            ("inputs", inputs, [s for s in self.stages if self.placement.is_first(s)]),
            ("targets", targets, [s for s in self.stages if self.placement.is_last(s)]),
        ):
            check_batch(self.who, name, data, ends, self.num_microbatches)
        problem = None
        if not forward_only:  # the plan's split: a plan file may split other than the default
            split = self.mb_pipeline or split_microbatches(
                self.num_microbatches, self.placement.num_pipelines
            )
            problem = reducing_too_early(self.stages, self.who, self.placement, split)
        if problem is not None:
            post_failure(problem, root=True)
            raise ValueError(problem)
        self.inputs, self.targets = inputs, targets
        self.training = not forward_only

    def forward(self, stage, mb, x):
        if x is None:
            x = self.inputs[mb].to(self.device)
        out = self.stages[stage](x)
        if self.placement.is_last(stage):
            loss = self.loss_fn(out, self.targets[mb].to(self.device))
            _check_loss(loss, stage, mb, self.training and out.requires_grad)
            return loss
        return out

    def loss_grad(self, stage, mb, loss):
        return torch.full_like(loss, 1.0 / self.num_microbatches)


def _check_loss(loss, stage: int, mb: int, needs_graph: bool = False) -> None:
    """A loss the backward can seed with ``1/m``: one number, and with ``needs_graph`` (a
    training step whose stage output requires grad) one that does. A loss of another shape
    would be seeded element by element, giving the gradients of its sum without a word; a
    loss without a graph (computed under ``no_grad``, detached) left every gradient zero."""
    if not isinstance(loss, torch.Tensor):
        got = f"a {type(loss).__name__}"
    elif loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}"
    elif needs_graph and not loss.requires_grad:
        raise ValueError(
            f"loss_fn returned a loss that does not require grad for micro-batch {mb} at "
            f"stage {stage} (computed under torch.no_grad() or detached?): the backward "
            "would leave every gradient zero; return the loss with its graph"
        )
    else:
        return
    raise ValueError(
        f"loss_fn returned {got} for micro-batch {mb} at stage {stage}: it must return a "
        "scalar tensor (reduce it, e.g. reduction='mean' or .mean())"
    )


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


def _reduces_gradients(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds torch's DistributedDataParallel or FSDP (either API)."""
    from torch.nn.parallel import DistributedDataParallel

    return any(isinstance(m, (DistributedDataParallel, *_sharding())) for m in module.modules())


def _sharding() -> tuple[type, ...]:
    """FSDP's module classes the caller has loaded: FullyShardedDataParallel, and
    fully_shard's FSDPModule where torch.distributed.fsdp exports it (torch 2.6 on; before,
    only in a private module); empty when torch.distributed.fsdp was never imported: a
    stage can be FSDP's only once its caller imported it, and importing FSDP here would pull
    in torch._dynamo (some 800 modules, a second) for every runtime built."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return ()
    fully_sharded = getattr(fsdp, "FSDPModule", None)
    return (fsdp.FullyShardedDataParallel, *([fully_sharded] if fully_sharded else []))


# [Note: data parallelism around the plain runtime] torch's DDP reduces the first backward
# after a forward and then waits for the next forward: a stage runs several forwards before
# their backwards (F0 F1 B0 B1), so only one micro-batch's gradients were averaged and the
# replicas drifted apart, without a word. FSDP reduces and frees a module's gradients when
# its backward ends, which under split backward is I: W's weight gradients came after, onto
# parameters already reduced (all lost). The runtime's data parallelism is the caller's
# all-reduce of the gradients over its data-parallel group after step() (README, "Data
# parallelism"); a DDP stage may run inside no_sync(), which leaves the reduction to it too.
# FSDP1 (FullyShardedDataParallel) is DDP's case or worse: unsharded (NO_SHARD) it reduces like
# DDP (96% off), sharded it frees the gathered parameters at the first micro-batch's backward,
# which the next one still needs. fully_shard (FSDP2) gathers again per backward and reduces
# once at the end: it runs as it is.
def reducing_too_early(
    stages: Mapping[int, torch.nn.Module],
    who: str,
    placement: Placement,
    mb_pipeline: Sequence[int],
) -> str | None:
    """Why a training step of these stages over micro-batches ``mb`` run by pipelines
    ``mb_pipeline[mb]`` (the plan's) would reduce gradients wrong or fail (a stage that runs
    more than one of them in torch's DDP outside ``no_sync()``, or in FSDP1), or None
    ([Note: data parallelism around the plain runtime])."""
    from torch.nn.parallel import DistributedDataParallel

    fsdp1 = _sharding()[:1]
    per_pipeline = Counter(mb_pipeline)
    for stage, module in stages.items():
        runs = per_pipeline[placement.pipeline_of(stage)]
        for wrapper in module.modules() if runs > 1 else ():
            if isinstance(wrapper, DistributedDataParallel) and wrapper.require_backward_grad_sync:
                return (
                    f"{who}: stage {stage} runs in torch's DistributedDataParallel, which "
                    f"reduces one backward per forward; the stage runs {runs} forwards "
                    "before their backwards, so its gradients would come out wrong. Drop the "
                    "wrapper and all-reduce the gradients over the data-parallel group after "
                    "step() (README, 'Data parallelism'), or step inside its no_sync()"
                )
            if isinstance(wrapper, fsdp1):
                return (
                    f"{who}: stage {stage} runs in torch's FullyShardedDataParallel "
                    f"(FSDP1), and the stage runs {runs} forwards before their backwards: "
                    "unsharded it reduces one backward per forward (wrong gradients), sharded "
                    "it frees the parameters the next backward needs. Shard the stage with "
                    "fully_shard (FSDP2) instead, or drop the wrapper and all-reduce the "
                    "gradients over the data-parallel group after step() (README, 'Data "
                    "parallelism')"
                )
    return None


def refuse_sharded_split(stages: Mapping[int, torch.nn.Module], who: str) -> None:
    """Refuse FSDP stages under split backward ([Note: data parallelism around the plain
    runtime]): ValueError naming the rank, the stage and the fix."""
    for stage, module in stages.items():
        if any(isinstance(m, _sharding()) for m in module.modules()):
            raise ValueError(
                f"{who}: stage {stage} is sharded by FSDP, which reduces its gradients "
                "when the backward's I ends, before W adds the weight gradients (they would "
                "be lost); run FSDP stages with a plan without split backward, or all-reduce "
                "unwrapped stages' gradients after step() (README, 'Data parallelism')"
            )


def refuse_sharded_replicas(
    stages: Mapping[int, torch.nn.Module], who: str, placement: Placement
) -> None:
    """Refuse fully_shard (FSDP2) stages of a ``bi`` placement: their gradients are shards
    (DTensors) that the replica sum cannot add, and whether the mirrored ranks hold the same
    shard depends on how the data-parallel groups were made. ValueError naming the rank, the
    stage and the fix."""
    fully_sharded = _sharding()[1:]
    if placement.direction != "bi" or not fully_sharded:
        return
    for stage, module in stages.items():
        if any(isinstance(m, fully_sharded) for m in module.modules()):
            raise ValueError(
                f"{who}: stage {stage} is sharded by fully_shard (FSDP2) and the "
                f"placement is bi ({placement.ranks} ranks, R={placement.reuse}): the replica "
                "sum cannot add sharded gradients. Run FSDP2 stages with a uni placement, or "
                "all-reduce unwrapped stages' gradients after step() and "
                "reduce_replica_grads() (README, 'Data parallelism')"
            )


def module_callbacks(
    stages: Mapping[int, torch.nn.Module],
    loss_fn: LossFn | None,
    plan: Plan,
    device: torch.device,
    rank: int,
    who: str | None = None,
) -> ModuleCallbacks:
    """A runtime's callbacks for plain-PyTorch ``stages`` running ``plan``; under split
    backward the stages' linear layers made split-capable (FSDP stages refused there, and
    FSDP2 stages of bi placements: [Note: data parallelism around the plain runtime])."""
    who = who or f"rank {rank}"
    try:
        if loss_fn is None:
            raise ValueError(f"{who}: give loss_fn, or callbacks that compute")
        refuse_sharded_replicas(stages, who, plan.placement)
        if plan.split_backward:
            refuse_sharded_split(stages, who)
    except ValueError as exc:  # past the plan check, the peers wait on this rank: say why
        post_failure(str(exc), root=True)
        raise
    placement, m = plan.placement, plan.num_microbatches
    callbacks = ModuleCallbacks(stages, loss_fn, placement, m, device, rank, who)
    callbacks.mb_pipeline = plan.mb_pipeline
    for module in stages.values() if plan.split_backward else ():
        enable_split_backward(module)
    return callbacks
