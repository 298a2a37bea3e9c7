"""megatron-core models and data for the integration tests (CPU, gloo, float64).

A reference run (one rank, no pipelining, megatron's own no-pipelining schedule) and PRT runs
of the same model with the same weights; parameters are compared by *global* name (layer
numbers of the unpipelined model), so every chunk's parameters find their reference.
"""

from __future__ import annotations

import re
from functools import partial

import torch
import torch.distributed as dist

VOCAB, SEQ, MBS, HIDDEN = 64, 8, 2, 16
DTYPE = torch.float64
# Where models and batches live: the CPU (through megatron_prt.megatron.cpu) in the tests;
# scripts/gpu_megatron_parity.py sets a GPU.
DEVICE = torch.device("cpu")


def setup_megatron(pp: int, vp: int | None):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_prt.megatron import cpu, embedding_ranks

    if DEVICE.type == "cpu":
        cpu.enable()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        get_embedding_ranks=embedding_ranks,
    )
    model_parallel_cuda_manual_seed(1234)


def transformer_config(num_layers: int, dtype: torch.dtype = DTYPE, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    fields.update(extra)
    return TransformerConfig(**fields)


def build_model(kind: str, config, pre_process=True, post_process=True, vp_stage=None):
    """``gpt`` (tied), ``gpt-untied``, ``bert`` (tied, binary head), ``bert-nobinary``."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(config.params_dtype)  # the torch-norm fallback ignores params_dtype
    try:
        return _build_model(kind, config, pre_process, post_process, vp_stage).to(DEVICE)
    finally:
        torch.set_default_dtype(default)


def _build_model(kind, config, pre_process, post_process, vp_stage):
    if kind.startswith("gpt"):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel

        return GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=kind == "gpt",
            vp_stage=vp_stage,
        )
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    return BertModel(
        config=config,
        num_tokentypes=2,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=True,
        add_binary_head=kind == "bert",
        vp_stage=vp_stage,
    )


def batches(num: int, step: int = 0, variable: bool = False):
    """Deterministic micro-batches (dicts of tensors), one per micro-batch; ``variable``:
    sequence lengths differ between micro-batches."""
    out = []
    for mb in range(num):
        g = torch.Generator().manual_seed(100 + 1000 * step + mb)
        seq = SEQ - 3 * (mb // 2 % 2) if variable else SEQ  # varies on every edge, bi too
        tokens = torch.randint(0, VOCAB, (MBS, seq), generator=g)
        out.append(
            {
                "tokens": tokens,
                "labels": torch.roll(tokens, -1, dims=1),
                "mask": (torch.rand(MBS, seq, generator=g) > 0.2).long(),
                "types": torch.randint(0, 2, (MBS, seq), generator=g),
                "sentence_order": torch.randint(0, 2, (MBS,), generator=g),
            }
        )
    return out


def forward_step(kind: str, per_token: bool, data_iterator, model):
    """megatron's forward_step_func contract: ``(output, loss_func)``."""
    batch = {key: value.to(DEVICE) for key, value in next(data_iterator).items()}
    if kind.startswith("gpt"):
        pos = torch.arange(batch["tokens"].shape[1], device=DEVICE).expand_as(batch["tokens"])
        out = model(batch["tokens"], pos, None, labels=batch["labels"])
    else:
        out = model(
            batch["tokens"], batch["mask"], tokentype_ids=batch["types"], lm_labels=batch["labels"]
        )
    return out, partial(loss_func, kind, per_token, batch)


def loss_func(kind, per_token, batch, output):
    binary = None
    if isinstance(output, tuple):  # BERT: (token losses, binary logits or None)
        output, binary = output
    token_loss = output
    mask = batch["mask"].to(token_loss.dtype)
    total = (token_loss * mask).sum()
    tokens = mask.sum()
    if binary is not None:
        total = total + torch.nn.functional.cross_entropy(binary, batch["sentence_order"]) * tokens
    if per_token:
        return total, tokens.to(torch.int), {"lm loss": torch.stack([total, tokens]).detach()}
    loss = total / tokens
    return loss, {"lm loss": loss.detach().clone()}


def global_name(model, name: str, tied: bool) -> str:
    """Parameter name in the unpipelined model: local layer index -> global layer number - 1;
    a tied output weight is the word embedding."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    name = name.removeprefix("module.").removeprefix("module.")
    match = re.match(r"(decoder|encoder)\.layers\.(\d+)\.(.*)", name)
    if match:
        block = getattr(inner, match.group(1))
        number = block.layers[int(match.group(2))].layer_number
        return f"{match.group(1)}.layers.{number - 1}.{match.group(3)}"
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name


def grads_by_name(models, tied: bool) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for model in models:
        for name, p in model.named_parameters():
            grad = getattr(p, "main_grad", None)
            grad = p.grad if grad is None else grad
            if grad is None:
                grad = torch.zeros_like(p)
            out.setdefault(global_name(model, name, tied), []).append(grad.detach().clone())
    return out


def params_by_name(models, tied: bool) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for model in models:
        for name, p in model.named_parameters():
            out.setdefault(global_name(model, name, tied), []).append(p.detach().clone())
    return out


def load_global(models, state: dict[str, torch.Tensor], tied: bool) -> None:
    with torch.no_grad():
        for model in models:
            for name, p in model.named_parameters():
                p.copy_(state[global_name(model, name, tied)])


def is_tied(kind: str) -> bool:
    return kind != "gpt-untied"


def reference(rank, world, kind, num_layers, m, per_token=False, variable=False):
    """One rank, megatron's no-pipelining schedule: losses, grads and initial weights."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    setup_megatron(1, None)
    torch.manual_seed(7)
    config = transformer_config(num_layers, calculate_per_token_loss=per_token)
    model = build_model(kind, config)
    config.variable_seq_lengths = variable
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    store = forward_backward_no_pipelining(
        forward_step_func=partial(forward_step, kind, per_token),
        data_iterator=iter(batches(m, variable=variable)),
        model=[model],
        num_microbatches=m,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    if per_token:  # megatron's finalize divides by the token count; here done by hand
        tokens = sum(int(s["lm loss"][1]) for s in store)
        grads = {n: g / tokens for n, g in grads.items()}
    return {"state": state, "grads": grads, "losses": [s["lm loss"] for s in store]}


def run_prt(
    rank,
    world,
    kind,
    m,
    reuse,
    ref_state,
    forward_only=False,
    per_token=False,
    variable=False,
    transport="auto",
):
    """This rank's PRT run of ``reuse``: losses (on rank P-1) and grads by global name."""
    from megatron_prt.megatron import make_forward_backward_func, prepare_model
    from megatron_prt.megatron.layout import chunk_roles
    from megatron_prt.megatron.model import transformer_config_kwargs

    placement = reuse.placement
    setup_megatron(placement.ranks, placement.chunks_per_rank)
    rank = dist.get_rank()
    config = transformer_config(
        calculate_per_token_loss=per_token, **transformer_config_kwargs(reuse)
    )
    config.variable_seq_lengths = variable  # set late: the constructor checks MoE settings
    model = [
        build_model(kind, config, role.pre_process, role.post_process, role.chunk)
        for role in chunk_roles(reuse, rank)
    ]
    load_global(model, ref_state, is_tied(kind))
    prepare_model(model, reuse)
    forward_backward = make_forward_backward_func(reuse, timeout_s=60, transport=transport)
    store = forward_backward(
        forward_step_func=partial(forward_step, kind, per_token),
        data_iterator=[iter(batches(m, variable=variable)) for _ in model],
        model=model,
        num_microbatches=m,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=forward_only,
    )
    grads = grads_by_name(model, is_tied(kind))
    if per_token:
        tokens = torch.tensor(float(sum(int(s["lm loss"][1]) for s in store)))
        dist.broadcast(tokens, src=placement.ranks - 1)  # megatron's finalize does this
        grads = {n: [g / tokens for g in gs] for n, gs in grads.items()}
    return {"losses": [s["lm loss"] for s in store], "grads": grads}


STEPS, LR, CLIP = 3, 1e-3, 1.0
# Adam's update of a weight with an exactly zero gradient (the attention key bias) is fp32
# rounding noise over eps; a larger eps keeps that noise far below the tolerance.
EPS = 1e-6


def train(rank, world, kind, m, reuse, ref_state):
    """STEPS steps of megatron's DDP + Adam (clip 1.0) in fp32, PRT when ``reuse`` is given,
    else megatron's no-pipelining schedule on one rank: per-step losses (on rank P-1), grad
    norms, final parameters and the sharded-state-dict keys, by global name."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_prt.megatron import make_forward_backward_func, prepare_model
    from megatron_prt.megatron.layout import chunk_roles
    from megatron_prt.megatron.model import transformer_config_kwargs

    if reuse is None:
        setup_megatron(1, None)
        config = transformer_config(LAYERS_TRAIN, torch.float32)
        model = [build_model(kind, config)]
        forward_backward = forward_backward_no_pipelining
    else:
        setup_megatron(reuse.placement.ranks, reuse.placement.chunks_per_rank)
        config = transformer_config(dtype=torch.float32, **transformer_config_kwargs(reuse))
        roles = chunk_roles(reuse, rank)
        model = [build_model(kind, config, r.pre_process, r.post_process, r.chunk) for r in roles]
        forward_backward = make_forward_backward_func(reuse, timeout_s=60)
    load_global(model, ref_state, is_tied(kind))
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False)
    model = [DistributedDataParallel(config, ddp_config, chunk) for chunk in model]
    if reuse is not None:
        prepare_model(model, reuse)
    config.no_sync_func = [chunk.no_sync for chunk in model]
    config.grad_sync_func = [chunk.start_grad_sync for chunk in model]
    config.finalize_model_grads_func = finalize_model_grads
    if len(model) == 1:
        config.no_sync_func, config.grad_sync_func = model[0].no_sync, model[0].start_grad_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, clip_grad=CLIP, weight_decay=0.0, adam_eps=EPS),
        model,
    )
    losses, norms = [], []
    for step in range(STEPS):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        store = forward_backward(
            forward_step_func=partial(forward_step, kind, False),
            data_iterator=[iter(batches(m, step)) for _ in model],
            model=model,
            num_microbatches=m,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
        ok, norm, _ = optimizer.step()
        assert ok
        losses.append([float(s["lm loss"]) for s in store])
        norms.append(norm)
    keys = []
    for chunk in model:
        for value in chunk.module.sharded_state_dict().values():
            if "_extra_state" not in value.key:  # checkpoint key, global position, main copy
                main = not any(value.replica_id)
                keys.append((value.key, tuple(getattr(value, "global_offset", ())), main))
    return {
        "losses": losses,
        "norms": norms,
        "params": params_by_name(model, is_tied(kind)),
        "keys": keys,
    }


LAYERS_TRAIN = 8
