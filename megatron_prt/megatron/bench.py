"""The megatron-core BERT section of ``megatron-prt bench``: one rank's side (CPU, gloo).

:class:`BertRunner` builds megatron-core's ``BertModel`` (local spec, tied embeddings, binary
head, float32) as this rank's chunks for one schedule variant and runs training steps of it
through :func:`megatron_prt.megatron.make_forward_backward_func` (the forward-backward
function a Megatron-LM training loop calls), on the same data for every variant.
:func:`profile_costs` is the one-rank profile (:func:`megatron_prt.megatron.profile_model`)
the simulator's predictions start from; :func:`calibrate_replica_sum` times the bi
replica-gradient sum of megatron's finalize path for them. The timing loop, the message
costs and the report live in :mod:`megatron_prt.bench.bert`, which imports this module
inside the ranks only.

Every variant shares one megatron parallel state (pipeline size P, embedding group of one
rank, as :func:`megatron_prt.megatron.embedding_ranks` asks); its virtual pipeline size is
set to the variant's chunks per rank while that variant is built or steps, so variants with
different R can alternate step by step. Every variant holds the same weights: those of the
1F1B split built from :data:`SEED` (:func:`reference_state`), loaded by global parameter
name (:mod:`megatron_prt.megatron.weights`), so every row computes the same losses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..core.placement import Placement
from . import cpu
from .config import ReuseConfig
from .layout import chunk_roles
from .model import embedding_ranks, prepare_model, transformer_config_kwargs
from .profile import profile_model
from .schedule import _uses_main_grad, make_forward_backward_func
from .weights import global_state, load_global

SEED = 1234


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


def init_parallel_state(ranks: int) -> None:
    """megatron's parallel state for ``ranks`` pipeline ranks on the CPU shim (collective)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu.enable()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=ranks, get_embedding_ranks=embedding_ranks
    )
    model_parallel_cuda_manual_seed(SEED)


def bert_batches(shape: BertShape, m: int) -> list[dict]:
    """``m`` micro-batches of random tokens, the same for every variant (seeded by ``m``)."""
    gen = torch.Generator().manual_seed(2000 + m)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, shape.vocab, (shape.mbs, shape.seq), generator=gen)
        out.append(
            {
                "tokens": tokens,
                "labels": torch.roll(tokens, -1, dims=1),
                "padding_mask": torch.ones(shape.mbs, shape.seq, dtype=torch.long),
                "types": torch.randint(0, 2, (shape.mbs, shape.seq), generator=gen),
                "sentence_order": torch.randint(0, 2, (shape.mbs,), generator=gen),
            }
        )
    return out


def bert_forward_step(data_iterator, model):
    """megatron's ``forward_step_func``: ``(output, loss_func)`` of one micro-batch."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["padding_mask"],
        tokentype_ids=batch["types"],
        lm_labels=batch["labels"],
    )
    return output, partial(bert_loss, batch)


def bert_loss(batch: dict, output):
    """Mean token loss plus the sentence-order loss (BERT pretraining's two losses)."""
    token_loss, order_logits = output
    loss = token_loss.float().mean()
    loss = loss + torch.nn.functional.cross_entropy(order_logits.float(), batch["sentence_order"])
    return loss, {"lm loss": loss.detach().clone()}  # megatron scales loss in place after


class BertRunner:
    """This rank's chunks of one variant (``placement``; ``schedule`` ``"1f1b"`` or
    ``"prt"``) and the forward-backward function that trains them on ``m`` micro-batches.
    ``step`` / ``zero_grad`` / ``peak_bytes`` / ``close`` as the layer-stack runners;
    ``plan`` is the plan that runs (for the simulator)."""

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
        rank = dist.get_rank()
        torch.manual_seed(SEED)
        self.config = self._config()
        self.chunks = [self._chunk(role) for role in chunk_roles(self.reuse, rank)]
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
    def grad_attr(self) -> str:
        """Where the finalize path reads and sums gradients (``main_grad`` under DDP)."""
        return "main_grad" if _uses_main_grad(self.chunks) else "grad"

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

    def _config(self):
        from megatron.core.transformer.transformer_config import TransformerConfig

        s = self.shape
        return TransformerConfig(
            hidden_size=s.hidden,
            num_attention_heads=s.heads,
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            **transformer_config_kwargs(self.reuse),
        )

    def _chunk(self, role) -> torch.nn.Module:
        from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
        from megatron.core.models.bert.bert_model import BertModel

        return BertModel(
            config=self.config,
            num_tokentypes=2,
            transformer_layer_spec=bert_layer_local_spec,
            vocab_size=self.shape.vocab,
            max_sequence_length=self.shape.seq,
            pre_process=role.pre_process,
            post_process=role.post_process,
            share_embeddings_and_output_weights=True,
            add_binary_head=True,
            vp_stage=role.chunk,
        )

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
    and fitted (:func:`megatron_prt.bench.common.calibrate_replica_sum`). Collective."""
    from ..bench.common import calibrate_replica_sum as fit

    small = replace(shape, hidden=2 * shape.heads, vocab=min(shape.vocab, 64))
    runners = [BertRunner(s, placement, "prt", 2) for s in (small, shape)]
    try:
        pipelines = [runner.forward_backward.pipeline() for runner in runners]
        return fit(*pipelines, repeats=repeats, grad_attr=runners[1].grad_attr)
    finally:
        for runner in runners:
            runner.close()
