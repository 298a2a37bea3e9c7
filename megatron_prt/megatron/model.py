"""Model chunks for a PRT placement: building, preparing, and the weights they share.

* :func:`model_provider` wraps a megatron ``model_provider`` so chunk ``vp_stage`` of this
  rank gets ``pre_process`` / ``post_process`` from the placement and the layer layout of
  :class:`~megatron_prt.megatron.layout.ReuseLayout`.
* :func:`build_chunks`: this rank's chunks, one :func:`model_provider` call per chunk;
  :func:`connect_model_hooks`: the DDP hooks of megatron's training loop for them.
* :func:`prepare_model` (once, after building, before the optimizer) or
  :func:`prepare_chunk` (per chunk, from a model provider): ``bi`` replica chunks copy
  pipeline 0's weights and are marked ``shared`` (the gradient norm counts each weight once)
  and as non-main checkpoint replicas; tied output weights copy the word embedding.
* :func:`running_chunk`: while a chunk computes, megatron's first/last-stage queries answer
  for that chunk's stage (so ``Float16Module`` casts at the model's real first and last
  stages, BERT computes position ids where the embedding is).
* :func:`tie_grads` (after each backward): the word embedding and its tied output weight
  both end with the sum of their gradients.

Tied weights are summed by megatron-prt, not by megatron's embedding group (which assumes the
last stage sits on pipeline rank P-1): initialise model parallel with
``get_embedding_ranks=embedding_ranks`` so that group holds one rank and stays idle.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..runtime.errors import collective
from ..runtime.p2p import wire_device
from ..runtime.replicas import copy_stages, exchange_pairs
from .config import ReuseConfig, check_recompute_blocks
from .layout import ReuseLayout, built_problem, chunk_roles, layout_problem
from .plan_flag import warn_other_kind

_PREPARED = "_megatron_prt_prepared"
_RUNNING: contextvars.ContextVar = contextvars.ContextVar("megatron_prt_chunk", default=None)
_QUERIES_PATCHED = False  # megatron's stage queries consult _RUNNING (patched once)


@contextlib.contextmanager
def running_chunk(pre_process: bool, post_process: bool) -> Iterator[None]:
    """While a chunk computes, megatron's ``parallel_state.is_pipeline_first_stage`` /
    ``is_pipeline_last_stage`` answer for that chunk's stage (they test pipeline rank 0 /
    P-1, which under ``wave`` or ``bi`` is not where the first and last stages are: BERT
    computes position ids and user ``get_batch`` functions load labels by them)."""
    if not _QUERIES_PATCHED:
        _answer_stage_queries_by_chunk()
    token = _RUNNING.set((pre_process, post_process))
    try:
        yield
    finally:
        _RUNNING.reset(token)


def _answer_stage_queries_by_chunk() -> None:
    """Patch (once) the stage queries megatron code makes while a chunk runs. With no chunk
    running they answer as megatron's do. ``pipeline_parallel.utils``'s rank/vp pair is what
    ``Float16Module`` casts by: inside a chunk the vp half answers True and the rank half
    for the chunk, so inputs go to half precision at the model's first stage and outputs back
    to fp32 at its last, wherever those sit."""
    from megatron.core.pipeline_parallel import utils

    for module, name, answer in (
        (parallel_state, "is_pipeline_first_stage", lambda first, last: first),
        (parallel_state, "is_pipeline_last_stage", lambda first, last: last),
        (utils, "is_pp_first_stage", lambda first, last: first),
        (utils, "is_pp_last_stage", lambda first, last: last),
        (utils, "is_vp_first_stage", lambda first, last: True),
        (utils, "is_vp_last_stage", lambda first, last: True),
    ):
        original = getattr(module, name)
        if getattr(original, "megatron_prt", False):
            continue

        def query(*args, _original=original, _answer=answer, **kwargs):
            running = _RUNNING.get()
            return _original(*args, **kwargs) if running is None else _answer(*running)

        query.megatron_prt = True  # type: ignore[attr-defined]
        setattr(module, name, query)
    global _QUERIES_PATCHED
    _QUERIES_PATCHED = True


def embedding_ranks(pp_ranks: list[int], vp_size: int | None = None) -> list[int]:
    """``get_embedding_ranks`` for megatron's ``initialize_model_parallel``: only the first
    pipeline rank, so megatron's tied-embedding all-reduce never runs (megatron-prt sums)."""
    return [pp_ranks[0]]


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def model_provider(provider: Callable, reuse: ReuseConfig) -> Callable:
    """Wrap ``provider(pre_process, post_process, vp_stage=..., config=..., ...)``: the
    placement decides pre/post; a ``config`` passed on gets the PRT layout."""

    @functools.wraps(provider)
    def build(pre_process=True, post_process=True, vp_stage=None, **kwargs):
        rank = parallel_state.get_pipeline_model_parallel_rank()
        role = chunk_roles(reuse, rank)[vp_stage or 0]
        config = kwargs.get("config")
        problem = layout_problem(config)
        if problem is not None:
            raise ValueError(f"model_provider: the config passed is {problem}")
        if config is not None:
            check_recompute_blocks(reuse, config)
        model = provider(
            pre_process=role.pre_process,
            post_process=role.post_process,
            vp_stage=vp_stage,
            **kwargs,
        )
        model.vp_stage = vp_stage
        if (vp_stage or 0) == 0:
            warn_other_kind(reuse.recorded_kind, model)
        return model

    return build


def build_chunks(provider: Callable, reuse: ReuseConfig | None, **kwargs) -> list:
    """This rank's model chunks in chunk order: ``provider`` through :func:`model_provider`
    once per chunk (``vp_stage`` 0, 1, ...; ``kwargs`` passed on); without PRT (``reuse``
    ``None``) the whole model, ``[provider(pre_process=True, post_process=True,
    vp_stage=None, **kwargs)]``. Needs megatron's parallel state (the pipeline rank)."""
    if reuse is None:
        return [provider(pre_process=True, post_process=True, vp_stage=None, **kwargs)]
    build = model_provider(provider, reuse)
    return [build(vp_stage=chunk, **kwargs) for chunk in range(reuse.placement.chunks_per_rank)]


def connect_model_hooks(config, chunks: list) -> None:
    """The config hooks for DDP-wrapped ``chunks``: ``finalize_model_grads`` at the end and,
    only with ``overlap_grad_reduce``, gradient reduction held back per chunk until its last
    backward (``no_sync_func``; for one chunk the callable itself, megatron's convention).
    ``grad_sync_func`` stays unset: each gradient buffer is reduced once per iteration.

    Without overlap, megatron's ``finish_grad_sync`` (called by ``finalize_model_grads``)
    starts and finishes the reduction itself. With overlap, DDP's gradient hooks start each
    bucket's reduction as its last gradient arrives (once the chunk's ``no_sync`` is
    released) and ``finish_grad_sync`` waits for it (or, in the first iteration, starts it);
    an explicit ``start_grad_sync`` after the chunk's last backward would reduce a buffer a
    second time (megatron asserts against it)."""
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = config.grad_sync_func = None
    if not all(chunk.ddp_config.overlap_grad_reduce for chunk in chunks):
        return
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    if len(chunks) == 1:
        config.no_sync_func = chunks[0].no_sync


def transformer_config_kwargs(reuse: ReuseConfig) -> dict:
    """The ``TransformerConfig`` fields a PRT model needs (merge into the config's kwargs)."""
    placement = reuse.placement
    chunks = placement.chunks_per_rank
    return {
        "num_layers": reuse.num_layers,
        "pipeline_model_parallel_size": placement.ranks,
        "virtual_pipeline_model_parallel_size": chunks if chunks > 1 else None,
        "pipeline_model_parallel_layout": ReuseLayout(reuse),
    }


def chunk_stages(reuse: ReuseConfig, rank: int, model: list) -> dict[int, torch.nn.Module]:
    """Plan stage -> model chunk of ``rank``."""
    return {role.stage: model[role.chunk] for role in chunk_roles(reuse, rank)}


def is_prepared(model: list) -> bool:
    return all(getattr(unwrap(chunk), _PREPARED, False) for chunk in model)


def prepare_model(model: list, reuse: ReuseConfig, group=None) -> None:
    """Make a freshly built model consistent across ranks (collective over the pipeline
    group ``group``, default megatron's). Idempotent."""
    for built in range(1, len(model) + 1):
        prepare_chunk(model[:built], reuse, group)


def prepare_chunk(model: list, reuse: ReuseConfig, group=None) -> None:
    """Prepare the newest chunk ``model[-1]`` (chunks are built in order 0, 1, ... on every
    rank, as megatron's ``get_model`` does): every replica and tied-weight copy whose two
    chunks now exist runs now, so a model provider can call this per chunk, before any
    wrapper or optimizer sees the weights. Collective over the pipeline group."""
    if getattr(unwrap(model[-1]), _PREPARED, False):
        return
    group = group or parallel_state.get_pipeline_model_parallel_group()
    placement = reuse.placement
    rank, chunk = dist.get_rank(group), len(model) - 1
    roles = chunk_roles(reuse, rank)
    stages = {role.stage: unwrap(model[role.chunk]) for role in roles if role.chunk <= chunk}
    problem = built_problem(unwrap(model[chunk]), roles[chunk])
    if chunk == 0:
        problem = problem or _embedding_group_problem(model)
    _refuse_on_every_rank(problem, roles[chunk], unwrap(model[chunk]), group)

    def completes_now(pair):
        return max(placement.stage_to_chunk[s] for s in pair) == chunk

    replicas = [pair for pair in placement.replica_pairs() if completes_now(pair)]
    copy_stages(replicas, placement.rank_of, stages, group)  # before ties: they copy from these
    tied = [pair for pair in _tied_pairs(reuse, stages) if completes_now(pair)]
    _copy_tied_weights(reuse, stages, tied, group)
    if placement.pipeline_of(placement.rank_stages[rank][chunk]) == 1:
        for param in model[chunk].parameters():
            param.shared = True  # the pipeline-0 copy is counted in the grad norm
        _mark_checkpoint_replica(unwrap(model[chunk]))
    setattr(unwrap(model[chunk]), _PREPARED, True)


def _mark_checkpoint_replica(module: torch.nn.Module) -> None:
    """A ``bi`` replica chunk saves nothing of its own: its sharded tensors become non-main
    replicas (first replica-id entry 1), so a checkpoint writes pipeline 0's copy once."""
    original = module.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(*args, **kwargs):
        state = original(*args, **kwargs)
        for value in state.values():
            replica = getattr(value, "replica_id", None)
            if isinstance(replica, tuple) and replica:
                value.replica_id = (1, *replica[1:])
            elif isinstance(replica, int):
                value.replica_id = replica + 1
        return state

    module.sharded_state_dict = sharded_state_dict


def _refuse_on_every_rank(problem: str | None, role, module, group) -> None:
    """Raise on every rank of ``group`` when any rank found a ``problem`` with its newest
    chunk (:func:`~megatron_prt.megatron.layout.built_problem`, the embedding group); one
    all_reduce first, so no rank waits alone in the copies that follow."""
    bad = torch.tensor([int(problem is not None)], device=wire_device(group, device_of(module)))
    with collective("the build check of prepare_model", group):
        dist.all_reduce(bad, op=dist.ReduceOp.SUM, group=group)
    if problem is not None:
        raise ValueError(problem)
    if bad.item():
        raise ValueError(
            f"rank {role.rank}: {bad.item()} other rank(s) refused their chunk {role.chunk} "
            "(see their errors)"
        )


def device_of(module: torch.nn.Module) -> torch.device:
    """Where ``module``'s parameters live (the CPU for a module without any)."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _embedding_group_problem(model: list) -> str | None:
    if not any(_shares_embeddings(unwrap(c)) for c in model):
        return None
    group = parallel_state.get_embedding_group(check_initialized=False)
    if group is not None and dist.get_world_size(group) > 1:
        return (
            "tied embeddings under megatron-prt: initialise model parallel with "
            "get_embedding_ranks=megatron_prt.megatron.embedding_ranks (megatron's embedding "
            "group assumes the last stage on pipeline rank P-1 and would sum gradients twice)"
        )
    return None


def _shares_embeddings(module) -> bool:
    return bool(getattr(module, "share_embeddings_and_output_weights", False))


def _tied_pairs(reuse: ReuseConfig, stages: Mapping[int, torch.nn.Module]):
    """(first stage, last stage) of each pipeline whose model ties its embeddings."""
    any_module = next(iter(stages.values()))
    return list(reuse.placement.end_pairs()) if _shares_embeddings(unwrap(any_module)) else []


def chunks_summed_after_schedule(placement, rank: int, chunks: list) -> set[int]:
    """Chunks of ``rank`` whose gradients PRT sums after the schedule: every chunk under
    ``bi`` (each stage's two weight replicas), and with tied embeddings the chunks holding a
    pipeline's first or last stage (word embedding and output weight). Their data-parallel
    reduction must start after those sums (see ``MegatronCallbacks.start_summed_grad_sync``)."""
    if placement.direction == "bi":
        return set(range(len(chunks)))
    if not any(_shares_embeddings(unwrap(chunk)) for chunk in chunks):
        return set()
    ends = {stage for pair in placement.end_pairs() for stage in pair}
    return {c for c, stage in enumerate(placement.rank_stages[rank]) if stage in ends}


def _tied_weight(module: torch.nn.Module) -> torch.nn.Parameter:
    return unwrap(module).shared_embedding_or_output_weight()


def _copy_tied_weights(reuse, stages, pairs, group) -> None:
    def apply(stage, received, _own):
        with torch.no_grad():
            _tied_weight(stages[stage]).copy_(received.view_as(_tied_weight(stages[stage])))

    exchange_pairs(
        pairs,
        reuse.placement.rank_of,
        group,
        lambda stage: _tied_weight(stages[stage]).detach().reshape(-1),
        apply,
        both_ways=False,
    )


def tie_grads(
    reuse: ReuseConfig,
    stages: Mapping[int, torch.nn.Module],
    group,
    grad_attr,
    timeout_s: float | None = None,
) -> None:
    """Word embedding and tied output weight both end with the sum of their gradients;
    ``timeout_s`` bounds the wait for the peer on gloo as the schedule's own waits are
    (None, and NCCL: the process group's timeout)."""

    def grad(stage):
        weight = _tied_weight(stages[stage])
        if getattr(weight, grad_attr, None) is None:
            setattr(weight, grad_attr, torch.zeros_like(weight))
        return getattr(weight, grad_attr)

    def apply(stage, received, own):
        grad(stage).copy_((own + received).view_as(grad(stage)))

    with collective("the tied embedding gradient sum", group):  # a failed wait names it
        exchange_pairs(
            _tied_pairs(reuse, stages),
            reuse.placement.rank_of,
            group,
            lambda stage: grad(stage).reshape(-1),
            apply,
            both_ways=True,
            timeout_s=timeout_s,
        )
