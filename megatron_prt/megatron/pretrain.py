"""megatron-core BERT (and GPT) as megatron-prt's benchmarks, profiler, examples and tests
build and train them.

* :func:`init_parallel_state`: megatron's parallel state with megatron-prt's embedding group;
* :func:`transformer_config`: no dropout, no fused kernels (they need apex / Transformer
  Engine), so the same model runs on CPU and GPU;
* :func:`build_model`: ``GPTModel`` or ``BertModel`` with the local spec; one chunk of a PRT
  placement when used as the provider of :func:`megatron_prt.megatron.model.build_chunks`;
* :func:`random_batch` / :func:`random_batches`: micro-batches of random tokens, every
  token in the loss, no padding;
* :func:`bert_forward_step` and :func:`pretrain_loss`: megatron's ``forward_step_func``
  contract with Megatron-LM's pretraining loss (masked mean of the token losses, plus the
  sentence-order loss when the binary head is there).
"""

from __future__ import annotations

from functools import partial

import torch

SEED = 1234


def init_parallel_state(
    ranks: int,
    virtual: int | None = None,
    seed: int = SEED,
    on_cpu: bool = True,
    tensor: int = 1,
) -> None:
    """megatron's parallel state for ``ranks`` pipeline ranks of ``virtual`` chunks each
    (``None``: one) and ``tensor`` tensor-parallel ranks (the data-parallel size is what
    the world size leaves), with megatron-prt's embedding group
    (:func:`megatron_prt.megatron.embedding_ranks`) and, ``on_cpu``, the CPU shim
    (:mod:`megatron_prt.megatron.cpu`); seeds megatron's RNG tracker with ``seed``.
    Collective."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from . import cpu
    from .model import embedding_ranks

    if on_cpu:
        cpu.enable()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=ranks,
        virtual_pipeline_model_parallel_size=virtual,
        get_embedding_ranks=embedding_ranks,
    )
    model_parallel_cuda_manual_seed(seed)


def transformer_config(dtype: torch.dtype = torch.float32, **fields):
    """megatron-core's ``TransformerConfig`` in ``dtype`` without dropout or fused kernels;
    ``fields`` (sizes, ``transformer_config_kwargs(reuse)``, ...) add to and override
    these settings."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    return TransformerConfig(**{**settings, **fields})


MODEL_KINDS = ("gpt", "gpt-untied", "bert", "bert-nobinary")
# Megatron-LM's --transformer-impl values: megatron-core's layer specs by what implements them.
TRANSFORMER_IMPLS = ("local", "transformer_engine")


def build_model(
    kind: str,
    config,
    vocab_size: int,
    seq_length: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    transformer_impl: str = "local",
    layer_spec=None,
):
    """megatron-core's ``GPTModel`` or ``BertModel``: ``gpt`` (embeddings tied to the output
    layer), ``gpt-untied``, ``bert`` (tied, two token types, binary head) or
    ``bert-nobinary``; ``pre_process`` / ``post_process`` / ``vp_stage`` as a model provider
    gets them. ``transformer_impl``: the layer spec, ``local`` (megatron-core's own modules,
    CPU and GPU) or ``transformer_engine`` (TE modules: CUDA with Transformer Engine
    installed; imported only here, on that path). ``layer_spec``: a megatron ``ModuleSpec``
    for the transformer layers instead (a TE spec with other options, a custom one)."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind must be one of {', '.join(MODEL_KINDS)}, got {kind!r}")
    spec = layer_spec if layer_spec is not None else layer_spec_of(kind, transformer_impl)
    common = dict(
        config=config,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )
    if kind.startswith("gpt"):
        from megatron.core.models.gpt.gpt_model import GPTModel

        return GPTModel(
            transformer_layer_spec=spec,
            share_embeddings_and_output_weights=kind == "gpt",
            **common,
        )
    from megatron.core.models.bert.bert_model import BertModel

    return BertModel(
        num_tokentypes=2,
        transformer_layer_spec=spec,
        share_embeddings_and_output_weights=True,
        add_binary_head=kind == "bert",
        **common,
    )


def layer_spec_of(kind: str, transformer_impl: str):
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(
            f"--transformer-impl must be one of {', '.join(TRANSFORMER_IMPLS)}, "
            f"got {transformer_impl!r}"
        )
    if transformer_impl == "transformer_engine":
        check_transformer_engine()
    if kind.startswith("gpt"):
        from megatron.core.models.gpt import gpt_layer_specs

        if transformer_impl == "local":
            return gpt_layer_specs.get_gpt_layer_local_spec()
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    from megatron.core.models.bert import bert_layer_specs

    if transformer_impl == "local":
        return bert_layer_specs.bert_layer_local_spec
    return bert_layer_specs.get_bert_layer_with_transformer_engine_spec()


def check_transformer_engine() -> None:
    """Refuse the Transformer Engine spec where it cannot run, naming the fix: TE is CUDA
    only (megatron_prt.megatron.cpu runs local specs) and must be installed."""
    if not torch.cuda.is_available():
        raise ValueError(
            "--transformer-impl transformer_engine needs CUDA (Transformer Engine has no CPU "
            "kernels); use --transformer-impl local on CPU"
        )
    try:
        import transformer_engine  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            "--transformer-impl transformer_engine: Transformer Engine is not installed "
            "(pip install transformer_engine[pytorch], or NVIDIA's PyTorch container); "
            "or use --transformer-impl local"
        ) from exc


def random_batch(
    vocab_size: int, mbs: int, seq: int, generator: torch.Generator | None = None, device=None
) -> dict[str, torch.Tensor]:
    """One micro-batch of ``mbs`` random sequences of ``seq`` tokens (labels: the tokens
    shifted by one), drawn from ``generator`` (torch's default one if ``None``)."""
    tokens = torch.randint(0, vocab_size, (mbs, seq), generator=generator, device=device)
    return {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, dims=1),
        "loss_mask": torch.ones(mbs, seq, device=device),
        "padding_mask": torch.ones(mbs, seq, dtype=torch.long, device=device),
        "types": torch.randint(0, 2, (mbs, seq), generator=generator, device=device),
        "sentence_order": torch.randint(0, 2, (mbs,), generator=generator, device=device),
    }


def random_batches(count: int, vocab_size: int, mbs: int, seq: int, seed: int) -> list[dict]:
    """``count`` :func:`random_batch` micro-batches on the CPU, the same for every ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [random_batch(vocab_size, mbs, seq, generator) for _ in range(count)]


def bert_forward_step(data_iterator, model):
    """megatron's ``forward_step_func``: ``(output, loss_func)`` of one micro-batch."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["padding_mask"],
        tokentype_ids=batch["types"],
        lm_labels=batch["labels"],
    )
    return output, partial(pretrain_loss, batch)


def pretrain_loss(batch: dict, output):
    """Masked mean of the token losses (Megatron-LM's GPT and BERT pretraining losses),
    plus the sentence-order loss for BERT's binary head; megatron's ``(loss, {name:
    value})`` protocol."""
    sentence_logits = None
    if isinstance(output, tuple):  # (token losses, binary logits)
        output, sentence_logits = output
    mask = batch["loss_mask"].reshape(-1).float()
    loss = (output.float().reshape(-1) * mask).sum() / mask.sum()
    if sentence_logits is not None:
        order = batch["sentence_order"]
        loss = loss + torch.nn.functional.cross_entropy(sentence_logits.float(), order)
    return loss, {"lm loss": loss.detach().clone()}  # megatron scales loss in place after
