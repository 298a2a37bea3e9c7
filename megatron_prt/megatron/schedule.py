"""megatron-core's pipeline forward-backward function, run as a PRT plan.

:func:`make_forward_backward_func` returns a function with megatron-core 0.16.1's keyword
contract (``forward_step_func, data_iterator, model, num_microbatches, seq_length,
micro_batch_size, decoder_seq_length, forward_only, collect_non_loss_data, first_val_step,
adjust_tensor_shapes_fn, p2p_communicator, pg_collection, force_all_reduce``) and semantics:

* ``forward_step_func(data_iterator, model_chunk) -> (output, loss_func)`` is called through
  megatron's own ``schedules.forward_step`` (loss protocol, per-token loss, MoE/MTP loss
  scales, autocast, timers), once per (chunk, micro-batch) the plan runs. Each chunk's
  iterator yields one batch per micro-batch, in micro-batch order, as megatron's interleaved
  schedule assumes; the function sees the batch of the micro-batch being computed.
* Returns megatron's ``forward_data_store`` (one entry per micro-batch, in order) on pipeline
  rank P-1, where megatron's training loop reads losses, even when a last stage runs on
  another rank (``wave`` with even R, ``bi``); ``[]`` elsewhere.
* Hooks: ``no_sync_func`` holds gradient reduction until a chunk's last backward, or, when
  ``grad_sync_func`` is set, until that call starts it after the chunk's last gradient
  (split backward: released before the chunk's last I, started after its last W, so
  megatron DDP sees every W's gradient); ``param_sync_func``
  runs before a chunk's first forward;
  after the schedule, ``bi`` replica gradients and tied embedding/output gradients are summed
  (the chunks holding them keep their reduction held until then, even with
  ``overlap_grad_reduce``, and start it right after) and ``finalize_model_grads_func`` runs
  (data-parallel reduce, per-token scaling);
  ``grad_scale_func`` scales the loss before backward; ``deallocate_pipeline_outputs`` frees
  sent activations; ``pipeline_dtype`` is the wire dtype; ``variable_seq_lengths`` sends
  every activation's shape with it.
* ``pg_collection.pp`` (else megatron's global pipeline group) carries the plan's messages;
  a ``p2p_communicator`` on another group is refused.

The model must have been prepared once with :func:`megatron_prt.megatron.prepare_model`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config

from ..core.actions import Op
from ..core.placement import ConfigError
from ..core.plan import Plan
from ..core.schedules import build_plan
from ..runtime.callbacks import StageCallbacks, run_backward
from ..runtime.executor import PipelineRuntime
from ..runtime.split_plan import split_backward_plan
from ..runtime.stages import tag_layer_split
from ..runtime.trace import gather_spans, write_measured
from .auto import AutoTuner
from .chunk_data import chunk_data
from .config import ReuseConfig
from .losses import gather_on_last_rank
from .model import (
    chunk_stages,
    chunks_summed_after_schedule,
    device_of,
    is_prepared,
    running_chunk,
    tie_grads,
    unwrap,
)
from .split import enable_megatron_split_backward
from .training import restart_grad_ready_counts
from .unsupported import refuse_unsupported


class MegatronCallbacks(StageCallbacks):
    """megatron's stage computations (see the module docstring): ``forward`` through
    ``schedules.forward_step``, the gradient-sync and parameter-sync hooks, loss scaling.
    :meth:`use` gives it one iteration's forward step function and data; the runtime's
    ``begin`` starts the iteration."""

    def __init__(self, plan, rank: int, chunks: list, config) -> None:
        self.config = config
        self.chunks = chunks
        self.placement = plan.placement
        self.num_microbatches = plan.num_microbatches
        self.stage_chunk = {s: c for c, s in enumerate(plan.placement.rank_stages[rank])}
        # split backward: a chunk's gradient reduction is released before its last I (its
        # last gradient hook of a parameter outside split layers) and started after its
        # last W (the last of every other parameter), see backward / weight_grad
        self.split = plan.split_backward
        grad_op = Op.I if self.split else Op.B
        self.last_backward = {a.stage: a.mb for a in plan.ranks[rank] if a.op is grad_op}
        self.last_weight_grad = {a.stage: a.mb for a in plan.ranks[rank] if a.op is Op.W}
        # megatron checks a chunk's vp_stage against the one passed; read it once, not per mb
        self.vp_stage = [getattr(unwrap(chunk), "vp_stage", None) for chunk in chunks]
        self.chunk_sync: list[contextlib.ExitStack] | None = None
        self.summed_after = chunks_summed_after_schedule(plan.placement, rank, chunks)

    def use(self, forward_step_func, data, collect_non_loss_data, first_val_step) -> None:
        self.step_fn, self.data = forward_step_func, data
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step

    def begin(self, inputs, targets, forward_only) -> None:
        self.forward_only = forward_only
        self.store: dict[int, object] = {}  # mb -> forward_data_store entry
        self.num_tokens = torch.zeros([], dtype=torch.int)
        self.forwarded: set[int] = set()  # chunks that ran a forward this iteration

    # -- gradient and parameter sync hooks ----------------------------------------------------
    def per_chunk(self, hook):
        if hook is None or isinstance(hook, list):
            return hook
        return [hook] * len(self.chunks)

    def hold_grad_sync(self, stack: contextlib.ExitStack) -> None:
        """For one iteration (until ``stack`` closes): hold gradient reduction."""
        no_sync = self.config.no_sync_func
        if isinstance(no_sync, list):
            self.chunk_sync = [contextlib.ExitStack() for _ in self.chunks]
            for chunk_stack, func in zip(self.chunk_sync, no_sync, strict=True):
                chunk_stack.enter_context(func())
                stack.push(chunk_stack.__exit__)
        else:  # one context for the whole model: released after the schedule
            self.chunk_sync = None
            if no_sync is not None:
                stack.enter_context(no_sync())

    def release_grad_sync(self, chunk: int) -> None:
        """Before a chunk's last backward: let its gradients reduce as they become ready
        (megatron's overlap); chunks whose gradients are summed after the schedule (``bi``
        replicas, tied embeddings) hold them until :meth:`start_summed_grad_sync`. With a
        ``grad_sync_func`` the backward stays held and that call starts the reduction, as in
        megatron's own schedules: Megatron-LM's ``train()`` sets it under
        ``--overlap-grad-reduce``, and DDP's hooks and the call both started it (an
        assertion in DDP at the second iteration)."""
        held = chunk in self.summed_after or self.config.grad_sync_func is not None
        if held or self.chunk_sync is None:
            return
        self.chunk_sync[chunk].close()

    def start_summed_grad_sync(self) -> None:
        """After the replica and tied sums, with megatron's overlap: start the held chunks'
        data-parallel reductions, all at once and asynchronously (each DDP bucket once;
        ``finalize_model_grads`` waits for them). Their buffers never count a gradient as
        ready (no_sync held through every backward), so DDP treats each iteration as its
        first: its own ``finish_grad_sync`` would start them; here they start before the
        rest of finalize and overlap one another. Without overlap finalize reduces all."""
        if self.chunk_sync is None:
            return
        for chunk in sorted(self.summed_after):
            self.chunks[chunk].start_grad_sync()

    # -- stage computations ---------------------------------------------------------------
    def forward(self, stage, mb, x):
        chunk = self.stage_chunk[stage]
        first = chunk not in self.forwarded
        if first:
            self.forwarded.add(chunk)
            param_sync = self.per_chunk(self.config.param_sync_func)
            if param_sync is not None and not self.forward_only:
                param_sync[chunk](self.chunks[chunk].parameters())
        store: list = []
        is_last = self.placement.is_last(stage)
        with running_chunk(self.placement.is_first(stage), is_last):
            out, num_tokens = self.megatron_forward(chunk, mb, x, store, first, is_last)
        if is_last:
            self.num_tokens += num_tokens.cpu()
            if store:
                self.store[mb] = store[0]
        return out

    def megatron_forward(self, chunk, mb, x, store, first, is_last):
        return schedules.forward_step(
            self.step_fn,
            self.data[chunk].for_mb(mb),
            self.chunks[chunk],
            self.num_microbatches,
            x,
            store,
            self.config,
            parallel_state.get_context_parallel_world_size(),
            collect_non_loss_data=self.collect_non_loss_data,
            is_first_microbatch=schedules.check_first_val_step(
                self.first_val_step, self.forward_only, first
            ),
            current_microbatch=mb,
            vp_stage=self.vp_stage[chunk],
            is_last_stage=is_last,
        )

    def loss_grad(self, stage, mb, loss):
        return None  # the loss is already scaled by 1/m (or per token) in forward_step

    def backward(self, stage, mb, out, grad):
        """B, and under split backward I (:meth:`StageCallbacks.input_grad` runs this with
        the weight GEMMs of split layers deferred to :meth:`weight_grad`)."""
        chunk = self.stage_chunk[stage]
        last = self.last_backward[stage] == mb
        if last:
            self.release_grad_sync(chunk)
        config = self.config
        if config.timers is not None:
            config.timers("backward-compute", log_level=2).start()
        if grad is None and config.grad_scale_func is not None:
            out = config.grad_scale_func(out)
        if out.requires_grad:
            run_backward(out, grad)
        if config.timers is not None:
            config.timers("backward-compute").stop()
        if last and not self.split:
            self.start_grad_sync(chunk)

    def weight_grad(self, stage, mb):
        config = self.config
        if config.timers is not None:
            config.timers("backward-compute", log_level=2).start()
        # a W into main_grad marks it so DDP's hook skips its own add; only for that hand-off
        # (a tied weight's other gradients, in I, must still be added)
        marked = [
            (w.weight, getattr(w.weight, "grad_added_to_main_grad", False))
            for w in self.deferred_weight_grads(stage, mb)
            if w.fused is not None
        ]
        super().weight_grad(stage, mb)
        for weight, before in marked:
            weight.grad_added_to_main_grad = before
        if config.timers is not None:
            config.timers("backward-compute").stop()
        if self.last_weight_grad[stage] == mb:
            self.start_grad_sync(self.stage_chunk[stage])

    def start_grad_sync(self, chunk: int) -> None:
        """After a chunk's last gradient: start its reduction (chunks summed after the
        schedule: in :meth:`start_summed_grad_sync`)."""
        if self.config.grad_sync_func is not None and chunk not in self.summed_after:
            self.per_chunk(self.config.grad_sync_func)[chunk](self.chunks[chunk].parameters())


class MegatronPipeline(PipelineRuntime):
    """The executor with :class:`MegatronCallbacks` and megatron's iteration (:meth:`run`)."""

    def __init__(
        self,
        plan,
        model: list,
        config,
        group,
        device,
        timeout_s: float,
        trace: bool = False,
        transport: str = "auto",
        measure_memory: bool = False,
    ) -> None:
        self.config = config
        self.chunks = list(model)
        callbacks = MegatronCallbacks(plan, dist.get_rank(group), self.chunks, config)
        if plan.split_backward:
            enable_megatron_split_backward(self.chunks)
        stages = {s: self.chunks[c] for s, c in callbacks.stage_chunk.items()}
        super().__init__(
            plan,
            stages,
            loss_fn=None,
            group=group,
            device=device,
            dtype=config.pipeline_dtype or torch.float32,
            timeout_s=timeout_s,
            deallocate_outputs=bool(config.deallocate_pipeline_outputs),
            trace=trace,
            variable_shapes=bool(config.variable_seq_lengths),
            transport=transport,
            measure_memory=measure_memory,
            callbacks=callbacks,
        )

    def run(self, forward_step_func, data, forward_only, collect_non_loss_data, first_val_step):
        """One iteration: ``{mb: forward_data_store entry}`` of this rank's last stages and
        the number of tokens they counted (per-token loss)."""
        callbacks = self.callbacks
        callbacks.use(forward_step_func, data, collect_non_loss_data, first_val_step)
        with contextlib.ExitStack() as sync_stack:
            if not forward_only:
                callbacks.hold_grad_sync(sync_stack)
            self.step(None, None, forward_only)
        for d in data:
            d.finish(self.plan.num_microbatches)
        return callbacks.store, callbacks.num_tokens


def make_forward_backward_func(
    reuse: ReuseConfig,
    timeout_s: float = 600.0,
    transport: str = "auto",
    measure_memory: bool = False,
    w_delay: int | str | None = "zb",
) -> Callable:
    """megatron's forward-backward function for ``reuse`` (see the module docstring).
    ``reuse.split_backward``: backward runs as I and W, in the core's zero-bubble plan
    (``w_delay`` ``"zb"``, :func:`megatron_prt.core.zerobubble.zero_bubble`) or, for an int
    or None, in ``reuse.schedule``'s order with each W that many compute actions after its I
    (None: at the end; :func:`megatron_prt.runtime.split_plan.split_backward_plan`).
    ``timeout_s`` bounds every wait on a peer before :class:`PipelineError`; ``transport``
    and ``measure_memory``: see :class:`megatron_prt.runtime.PipelineRuntime`; the returned
    function's ``memory_stats()`` gives the last call's activation memory on this rank.

    Over 60 lines because the returned closure takes megatron's forward-backward keyword
    signature as it is (14 parameters), and one call's steps read best in one place."""
    pipelines = _Pipelines(reuse, w_delay, timeout_s, transport, measure_memory)
    auto = AutoTuner(reuse) if reuse.auto_iterations else None
    traced = []  # the first training iteration is written to reuse.trace_path

    def forward_backward_pipelining_with_reuse(
        *,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable | None = None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce: bool | None = False,
    ):
        model = model if isinstance(model, list) else [model]
        config = get_model_config(model[0])
        _check_call(reuse, model, config, adjust_tensor_shapes_fn)
        group = _pp_group(pg_collection, p2p_communicator)
        shape = (num_microbatches, seq_length, micro_batch_size, decoder_seq_length)
        pipeline = pipelines.get(model, config, group, shape, forward_only)
        data = chunk_data(data_iterator, len(model))
        profiled = auto is not None and auto.profiling and not forward_only
        if profiled:
            auto.before(pipeline)

        def iteration():  # the call's work: what auto's measured pick times
            store, num_tokens = pipeline.run(
                forward_step_func, data, forward_only, collect_non_loss_data, first_val_step
            )
            store, num_tokens = gather_on_last_rank(
                reuse, group, store, num_tokens, pipeline.device, pipeline.timeout_s
            )
            if not forward_only:
                _finalize(
                    reuse, model, pipeline, config, num_tokens, pg_collection, force_all_reduce
                )
            return store

        with _forward_backward_timer(config):
            store = auto.timed(pipeline, iteration) if profiled else iteration()
            if not forward_only:
                if reuse.trace_path and not traced:
                    traced.append(_write_trace(reuse.trace_path, pipeline, group))
                tuned = auto.after(pipeline, group) if profiled else None
                if tuned is not None:  # between iterations: the next call runs it
                    pipelines.switch(tuned, final=auto.done)
        return store

    _expose(forward_backward_pipelining_with_reuse, reuse, pipelines.last)
    # --pipeline-reuse auto's AutoTuner (None without auto): its candidates and measured pick
    forward_backward_pipelining_with_reuse.auto = auto  # type: ignore[attr-defined]
    forward_backward_pipelining_with_reuse.resume_auto = (  # type: ignore[attr-defined]
        functools.partial(_resume_auto, auto, pipelines)
    )
    return forward_backward_pipelining_with_reuse


KEPT_RUNTIMES = 8  # call shapes x plans (auto's measured pick alternates a few plans)


class _Pipelines:
    """The runtimes of one :func:`make_forward_backward_func`, one per call shape and model;
    ``last`` holds the last call's (empty before the first)."""

    def __init__(
        self,
        reuse: ReuseConfig,
        w_delay: int | str | None,
        timeout_s: float,
        transport: str,
        measure_memory: bool,
    ) -> None:
        self.reuse, self.w_delay, self.timeout_s = reuse, w_delay, timeout_s
        self.transport, self.measure_memory = transport, measure_memory
        self.by_key: dict[tuple, MegatronPipeline] = {}
        self.last: list[MegatronPipeline] = []
        self.trained: MegatronPipeline | None = None  # the last training call's

    def get(self, model: list, config, group, shape: tuple, forward_only: bool) -> MegatronPipeline:
        """The runtime for ``shape`` (num_microbatches, seq_length, micro_batch_size,
        decoder_seq_length) over ``model``, built on first use; it becomes ``last``. At
        most :data:`KEPT_RUNTIMES` are kept (and every candidate of auto's measured pick),
        the least recently used closed: a run whose lengths change every iteration built
        one per length, each holding its rings and sockets, until the process ran out. (One
        runtime for every length would size its shared-memory rings from the first.)"""
        plan = self.reuse.plan
        if plan is not None and not forward_only and plan.num_microbatches != shape[0]:
            # before the lookup: an evaluation at this count keyed its default plan here
            raise ConfigError(
                f"--pipeline-reuse-plan schedules {plan.num_microbatches} micro-batches "
                f"per iteration, this call runs {shape[0]}; set --global-batch-size to "
                "match or tune with the run's count"
            )
        key = (*shape, id(model[0]), id(plan))
        if key in self.by_key:
            self.by_key[key] = self.by_key.pop(key)  # most recently used last
        else:
            kept = max(KEPT_RUNTIMES, self.reuse.auto_candidates + 2)
            while len(self.by_key) >= kept:  # the same calls on every rank
                self.by_key.pop(next(iter(self.by_key))).close()
            plan = self._plan(shape[0])
            device = device_of(model[0])
            tag_layer_split(model, self.reuse.layers_per_stage())  # checked across ranks
            self.by_key[key] = MegatronPipeline(
                plan,
                model,
                config,
                group,
                device,
                self.timeout_s,
                trace=bool(self.reuse.trace_path),
                transport=self.transport,
                measure_memory=self.measure_memory,
            )
        pipeline = self.by_key[key]
        self.last[:] = [pipeline]
        if not forward_only:
            if self.trained is not None and pipeline is not self.trained:
                restart_grad_ready_counts(model)
            self.trained = pipeline
        return pipeline

    def switch(self, plan, final: bool = True) -> None:
        """Run ``plan`` from the next call on (``--pipeline-reuse auto``). ``final``: the
        runtimes built for other plans are closed; else they stay for a switch back (the
        measured pick alternates its candidates and must not time their builds)."""
        self.reuse = replace(self.reuse, plan=plan)
        for key in [k for k in self.by_key if final and k[-1] != id(plan)]:
            self.by_key.pop(key).close()

    def _plan(self, num_microbatches: int):
        """``--pipeline-reuse-plan``'s plan, else the one built for the configuration.
        Evaluation may run another micro-batch count: then the default plan (forward only)."""
        plan = self.reuse.plan
        if plan is None or plan.num_microbatches != num_microbatches:  # (evaluation: get)
            plan = _plan(self.reuse, num_microbatches, self.w_delay)
        return plan


def _resume_auto(auto: AutoTuner | None, pipelines: _Pipelines, plan: Plan) -> None:
    """Run ``plan``, a checkpoint's final pick of ``--pipeline-reuse auto``, from the next
    call on ([Note: auto's pick is resumed] in :mod:`megatron_prt.megatron.auto`)."""
    if auto is None:
        raise ConfigError("a checkpoint's auto pick resumed without --pipeline-reuse auto")
    auto.resume(plan)
    pipelines.switch(plan)


def _pp_group(pg_collection, p2p_communicator=None):
    """The pipeline group: ``pg_collection``'s when it has one, else megatron's global one.

    The plan's messages go over this group; a ``p2p_communicator`` on another group (which
    megatron's schedules would send over) is refused, not ignored."""
    group = pg_collection.pp if pg_collection is not None else None
    group = group or parallel_state.get_pipeline_model_parallel_group()
    theirs = getattr(p2p_communicator, "pp_group", None)
    if theirs is not None and theirs is not group:
        ours, given = dist.get_process_group_ranks(group), dist.get_process_group_ranks(theirs)
        if given != ours:
            raise ConfigError(
                f"megatron-prt: p2p_communicator's pipeline group (ranks {given}) is not the "
                f"pipeline group the plan runs on (ranks {ours}, pg_collection.pp or megatron's "
                "own); pass the same group in both, or leave p2p_communicator out"
            )
    return group


@contextlib.contextmanager
def _forward_backward_timer(config):
    """megatron's "forward-backward" timer around the block, when ``config.timers`` is set
    (left running when the block raises)."""
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    yield
    if config.timers is not None:
        config.timers("forward-backward").stop()


def _expose(forward_backward_func: Callable, reuse: ReuseConfig, last: list) -> None:
    """Attach to ``forward_backward_func`` its ``reuse``, ``memory_stats()`` (the last call's
    activation memory on this rank) and ``pipeline()``; ``last`` holds the runtime of the
    last call (empty before the first)."""
    forward_backward_func.reuse = reuse  # type: ignore[attr-defined]
    forward_backward_func.memory_stats = lambda: last[0].memory_stats()  # type: ignore[attr-defined]
    # The runtime of the last call (None before the first): its trace_enabled /
    # measure_memory switches and trace() / memory_stats() for tools and examples.
    forward_backward_func.pipeline = (  # type: ignore[attr-defined]
        lambda: last[0] if last else None
    )


def _plan(reuse: ReuseConfig, num_microbatches: int, w_delay: int | str | None):
    """The plan of one iteration: ``reuse.schedule``'s, split as ``w_delay`` says (see
    :func:`make_forward_backward_func`) when ``reuse.split_backward``."""
    placement = reuse.placement
    plan = build_plan(placement, num_microbatches, schedule=reuse.schedule)
    if not reuse.split_backward or plan.split_backward:
        return plan
    if w_delay == "zb":
        return build_plan(placement, num_microbatches, schedule="zb")
    return split_backward_plan(plan, w_delay)


def _write_trace(path_prefix: str, pipeline: MegatronPipeline, group) -> list[str]:
    """Collective over the pipeline group: one rank per model replica writes
    ``<prefix>.json`` (Chrome trace) and ``<prefix>.png`` of this iteration, in seconds."""
    spans = gather_spans(pipeline, group)
    writer = (
        dist.get_rank(group) == 0
        and parallel_state.get_data_parallel_rank() == 0
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    if not writer:
        return []
    return write_measured(path_prefix, spans, pipeline)


def _check_call(reuse: ReuseConfig, model: list, config, adjust_tensor_shapes_fn) -> None:
    placement = reuse.placement
    if len(model) != placement.chunks_per_rank:
        raise ValueError(
            f"{len(model)} model chunks given; {placement} needs {placement.chunks_per_rank} "
            "per rank (build them with megatron_prt.megatron.model_provider)"
        )
    if not is_prepared(model):
        raise RuntimeError(
            "call megatron_prt.megatron.prepare_model(model) once after building the model "
            "chunks and before building the optimizer"
        )
    if adjust_tensor_shapes_fn is not None:
        raise NotImplementedError("megatron-prt does not support adjust_tensor_shapes_fn")
    refuse_unsupported(config, placement)


def _finalize(reuse, model, pipeline, config, num_tokens, pg_collection, force_all_reduce):
    """Replica sums (bi), tied embedding sums, then megatron's finalize (data-parallel reduce,
    per-token scaling). Sums are linear, so their order against the DP reduce is free."""
    stages = chunk_stages(reuse, pipeline.rank, model)
    attr = grad_attr(model)
    if reuse.placement.direction == "bi":
        pipeline.reduce_replica_grads(attr)
    tie_grads(reuse, stages, pipeline.group, attr, pipeline.timeout_s)
    pipeline.callbacks.start_summed_grad_sync()  # overlap: the DP reduce sees summed grads
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(
            model,
            num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )


def grad_attr(model: list) -> str:
    """Where ``model``'s chunks accumulate gradients: ``main_grad`` under megatron-core's
    DDP (its gradient buffers), else ``grad``."""
    has_main = any(hasattr(p, "main_grad") for chunk in model for p in chunk.parameters())
    return "main_grad" if has_main else "grad"
