"""The megatron-core BERT section of ``megatron-prt bench``: one rank's side (CPU, gloo).

:class:`BertRunner` builds megatron-core's ``BertModel`` (local spec, tied embeddings, binary
head, float32) as this rank's chunks for one schedule variant and runs training steps of it
through :func:`megatron_prt.megatron.make_forward_backward_func` (the forward-backward
function a Megatron-LM training loop calls), on the same data for every variant.
:func:`profile_costs` is the one-rank profile (:func:`megatron_prt.megatron.profile_model`)
the simulator's predictions start from; :func:`calibrate_replica_sum` times the bi
replica-gradient sum of megatron's finalize path for them. The timing loop, the message
costs and the report live in :mod:`megatron_prt.bench.bert`, which imports this module
inside the ranks only. For the partition-memory benchmark
(:mod:`megatron_prt.bench.partition_memory`), :func:`step_memory` runs one training step
under megatron's DDP and Adam (:func:`training_setup`) and counts activation and
training-state bytes.

Every variant shares one megatron parallel state
(:func:`megatron_prt.megatron.pretrain.init_parallel_state`: pipeline size P, embedding group
of one rank, as :func:`megatron_prt.megatron.embedding_ranks` asks); its virtual pipeline size
is set to the variant's chunks per rank while that variant is built or steps, so variants with
different R can alternate step by step. Every variant holds the same weights: those of the
1F1B split built from :data:`SEED` (:func:`reference_state`), loaded by global parameter
name (:mod:`megatron_prt.megatron.weights`), so every row computes the same losses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial

import torch
from megatron.core import parallel_state

from ..core.placement import Placement
from ..runtime.replica_timing import calibrate_replica_sync
from .config import ReuseConfig
from .model import build_chunks, prepare_model, transformer_config_kwargs
from .pretrain import (
    SEED,
    bert_forward_step,
    build_model,
    init_parallel_state,
    random_batches,
    transformer_config,
)
from .profile import profile_model
from .schedule import grad_attr as chunks_grad_attr
from .schedule import make_forward_backward_func
from .training import build_training
from .weights import global_state, load_global


@dataclass(frozen=True)
class BertShape:
    """The benchmarked BERT: ``layers`` transformer layers of width ``hidden``, sequences of
    ``seq`` tokens, ``mbs`` sequences per micro-batch, a ``vocab``-token vocabulary."""

    layers: int
    hidden: int
    heads: int
    seq: int
    mbs: int
    vocab: int


def profile_costs(shape: BertShape, reps: int) -> dict:
    """Cost JSON of one micro-batch (see :mod:`megatron_prt.megatron.profile`), measured on
    this process's one-rank group with one CPU thread."""
    return profile_model(
        "bert",
        shape.layers,
        shape.hidden,
        shape.heads,
        shape.seq,
        shape.mbs,
        shape.vocab,
        reps=reps,
        threads=1,
    )


def bert_batches(shape: BertShape, m: int) -> list[dict]:
    """``m`` micro-batches of random tokens, the same for every variant (seeded by ``m``)."""
    return random_batches(m, shape.vocab, shape.mbs, shape.seq, seed=2000 + m)


class BertRunner:
    """This rank's chunks of one variant (``placement``; ``schedule`` ``"1f1b"`` or
    ``"prt"``) and the forward-backward function that trains them on ``m`` micro-batches.
    ``step`` / ``zero_grad`` / ``peak_bytes`` / ``close`` / ``wire`` as the layer-stack
    runners; ``plan`` is the plan that runs (for the simulator)."""

    def __init__(
        self,
        shape: BertShape,
        placement: Placement,
        schedule: str,
        m: int,
        state: dict[str, torch.Tensor] | None = None,
    ):
        """``state``: weights by global name (:func:`reference_state`) to load; ``None``
        keeps the seeded initialisation of this split."""
        self.shape, self.m = shape, m
        self.reuse = ReuseConfig(placement, shape.layers, schedule=schedule)
        self._vp = placement.chunks_per_rank if placement.chunks_per_rank > 1 else None
        self._enter()
        torch.manual_seed(SEED)
        self.config = transformer_config(
            hidden_size=shape.hidden,
            num_attention_heads=shape.heads,
            **transformer_config_kwargs(self.reuse),
        )
        self.chunks = build_chunks(
            partial(build_model, "bert", vocab_size=shape.vocab, seq_length=shape.seq),
            self.reuse,
            config=self.config,
        )
        prepare_model(self.chunks, self.reuse)
        if state is not None:  # every replica and tied copy by its global name
            load_global(self.chunks, state, tied=True)
        self.forward_backward = make_forward_backward_func(self.reuse, timeout_s=120)
        self.batches = bert_batches(shape, m)
        self.losses: list[float] = []
        self.replica_sum_s: list[float] = []  # bi: the sum inside each step's finalize
        self.step()  # builds the runtime, so ``plan`` exists
        self.plan = self.forward_backward.pipeline().plan
        if placement.direction == "bi":
            self._time_replica_sums()

    @property
    def wire(self) -> str:
        """The class of the transport the runtime chose."""
        return type(self.forward_backward.pipeline().transport).__name__

    @property
    def grad_attr(self) -> str:
        """Where the finalize path reads and sums gradients (``main_grad`` under DDP)."""
        return chunks_grad_attr(self.chunks)

    def _time_replica_sums(self) -> None:
        """Record each step's ``reduce_replica_grads`` (called by the forward-backward
        function's finalize) in ``replica_sum_s``."""
        pipeline = self.forward_backward.pipeline()
        reduce = pipeline.reduce_replica_grads

        def timed(*args, **kwargs):
            start = time.perf_counter()
            reduce(*args, **kwargs)
            self.replica_sum_s.append(time.perf_counter() - start)

        pipeline.reduce_replica_grads = timed  # instance attribute: shadows the method

    def _enter(self) -> None:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(self._vp)

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad(set_to_none=True)

    def step(self) -> None:
        """One training step's forward and backward over all ``m`` micro-batches."""
        self._enter()
        store = self.forward_backward(
            forward_step_func=bert_forward_step,
            data_iterator=[iter(self.batches) for _ in self.chunks],
            model=self.chunks,
            num_microbatches=self.m,
            seq_length=self.shape.seq,
            micro_batch_size=self.shape.mbs,
        )
        if store:
            self.losses = [float(entry["lm loss"]) for entry in store]

    def peak_bytes(self) -> int:
        """Activation bytes this rank held for backward at most, in one untimed step."""
        self.zero_grad()
        pipeline = self.forward_backward.pipeline()
        pipeline.measure_memory = True
        try:
            self.step()
        finally:
            pipeline.measure_memory = False
        return pipeline.memory_peak()

    def close(self) -> None:
        self.forward_backward.pipeline().close()


def reference_state(shape: BertShape, ranks: int) -> dict[str, torch.Tensor]:
    """The weights of the 1F1B split built from :data:`SEED`, by global parameter name, on
    every rank (collective): what every variant loads."""
    runner = BertRunner(shape, Placement(ranks), "1f1b", 1)
    try:
        return global_state(runner.chunks, tied=True)
    finally:
        runner.close()


def calibrate_replica_sum(shape: BertShape, placement: Placement, repeats: int) -> dict:
    """The bi replica-gradient sum of megatron's finalize path
    (``MegatronPipeline.reduce_replica_grads`` on the gradients it sums), timed on the
    benchmarked model and on one of hidden size ``2 * heads`` with a 64-token vocabulary,
    and fitted (:func:`megatron_prt.runtime.replica_timing.calibrate_replica_sync`).
    Collective."""
    small = replace(shape, hidden=2 * shape.heads, vocab=min(shape.vocab, 64))
    runners = [BertRunner(s, placement, "prt", 2) for s in (small, shape)]
    try:
        pipelines = [runner.forward_backward.pipeline() for runner in runners]
        return calibrate_replica_sync(*pipelines, repeats=repeats, grad_attr=runners[1].grad_attr)
    finally:
        for runner in runners:
            runner.close()


# -- partition_memory: one training step with megatron's DDP and Adam, memory counted ---------
def step_memory(shape: BertShape, reuse: ReuseConfig, microbatches: int) -> dict[str, int]:
    """One training step of this rank's chunks of ``shape`` under ``reuse``, as Megatron-LM
    drives it (megatron's DDP and Adam around PRT's forward-backward); collective over the
    pipeline group. Returns bytes: ``act_peak`` / ``act_held_after`` activations held for
    backward (the runtime's meter during the step: the peak; what is left at the end),
    ``params`` / ``grads`` / ``optimizer`` distinct storages after the optimizer step
    (:func:`state_bytes`)."""
    chunks, optimizer = training_setup(shape, reuse)
    forward_backward = make_forward_backward_func(reuse, timeout_s=300, measure_memory=True)
    batches = random_batches(microbatches, shape.vocab, shape.mbs, shape.seq, seed=0)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward(
        forward_step_func=bert_forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=microbatches,
        seq_length=shape.seq,
        micro_batch_size=shape.mbs,
    )
    stats = forward_backward.memory_stats()
    optimizer.step()  # Adam allocates its moments on the first step
    forward_backward.pipeline().close()
    params, grads, moments = state_bytes(chunks, optimizer)
    return {
        "act_peak": stats["peak_bytes"],
        "act_held_after": stats["held_bytes"],
        "params": params,
        "grads": grads,
        "optimizer": moments,
    }


def training_setup(shape: BertShape, reuse: ReuseConfig) -> tuple[list, object]:
    """This rank's chunks in megatron's DDP (no overlap, as on CPU) and megatron's Adam, set
    up by :func:`megatron_prt.megatron.training.build_training`."""
    from megatron.core.optimizer import OptimizerConfig

    chunks_per_rank = reuse.placement.chunks_per_rank
    init_parallel_state(reuse.placement.ranks, chunks_per_rank if chunks_per_rank > 1 else None)
    torch.manual_seed(1234)
    config = transformer_config(
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        deallocate_pipeline_outputs=True,  # as Megatron-LM runs: sent outputs are freed
        **transformer_config_kwargs(reuse),
    )
    provider = partial(build_model, "bert", vocab_size=shape.vocab, seq_length=shape.seq)
    chunks = build_chunks(provider, reuse, config=config)
    optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-4)
    training = build_training(chunks, config, optimizer_config=optimizer_config, reuse=reuse)
    return training.chunks, training.optimizer


def state_bytes(chunks: list, optimizer) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of distinct storages: a storage shared
    by several tensors (DDP's gradient buffer, ``param.grad`` aliasing ``main_grad``)
    counts once, in the first category that holds it."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    moments = [
        value
        for torch_optimizer in _torch_optimizers(optimizer)
        for state in torch_optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    ]
    seen: set = set()
    return tuple(_distinct_bytes(group, seen) for group in (params, grads, moments))


def _distinct_bytes(tensors: list[torch.Tensor], seen: set) -> int:
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (chained or single) optimizer."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in inner]
