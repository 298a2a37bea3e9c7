"""Profile a megatron-core model into a cost model: time, activation and parameter bytes.

:func:`profile_model` builds a megatron-core GPT (``gpt``: ``GPTModel``, local spec, tied
embeddings) or BERT (``bert``: ``BertModel``, local spec, tied embeddings, binary head) on
one rank, runs whole forward + backward passes of one micro-batch through megatron's own
``schedules.forward_step`` (so the loss is computed as in training), and reports per part
of the model: every transformer layer, the embedding (what the first stage adds) and the
head (final layer norm, output layer, cross-entropy and loss function; for BERT also the
LM head, pooler and binary head: what the last stage adds). The result is the cost JSON
the simulator and the partitioner read (:class:`megatron_prt.sim.cost.CostModel`)::

    {"layers": [{"fwd": s, "bwd": s, "act": bytes, "param": bytes, "grad": bytes,
                 "split_fwd": s, "split_bwd": s, "wgrad": s, "wact": bytes}, ...],
     "embedding": {...the same keys}, "head": {...}, "stage": {"fwd": s, "bwd": s, ...},
     "message_bytes": bytes, "fwd_time": s, "bwd_time": s,
     "activation_bytes": bytes, "param_bytes": bytes, "grad_bytes": bytes,
     "model": {"model": kind, "hidden_size": ..., "seq_length": ..., ...}}

* ``fwd`` / ``bwd``: seconds, median over ``reps`` passes (after one warm-up pass), timed by
  hooks at the part boundaries (forward hooks on the embedding and the layers; gradient
  hooks on their outputs), so the parts add up to the whole pass. A layer's forward runs
  from its start to the next layer's start; the head's from the last layer's end to the
  loss. ``stage``: what a middle chunk of one layer spends outside it in megatron's
  ``forward_step`` and its backward, the work every pipeline stage's step adds; taken out
  of the embedding's forward and the head's backward, where the one pass profiled put it
  ([Note: every stage pays its step's work] in :mod:`megatron_prt.sim.cost`).
* ``split_fwd`` / ``split_bwd`` / ``wgrad`` (unless ``split_backward=False``): the same
  passes in the split form, megatron's linear layers split-capable: the forward, I + W and
  W (each part's deferred weight GEMMs applied on their own), the split form's own costs
  ([Note: the split form's own costs] in :mod:`megatron_prt.sim.layer_cost`); ``wact``:
  the bytes each part's deferred W keeps from I until W (its split linear layers' inputs
  and output gradients, each storage once, as the runtime's meter counts them), which
  prices a split plan's memory where the default share of ``act`` would guess.
* ``act``: bytes held for backward for one micro-batch, as
  :mod:`megatron_prt.runtime.memory` defines them (distinct non-parameter storages that
  autograd saves). Each storage is attributed to the first part that saves it: a layer's
  input is saved by its first layer norm, so it belongs to that layer (the embedding output
  to layer 0, the last layer's output to the head), matching a pipeline stage, whose
  input is saved by its first layer. Storages saved again by the next micro-batch are
  caches, not activations (megatron's causal mask) and are left out: two passes are
  measured (both held at once, so profiling needs memory for two micro-batches) and their
  common storages removed. BERT's padding mask is built once per model chunk and saved by
  every layer of it; it is attributed to layer 0 only (``seq**2 * mbs`` bytes, missed on
  later stages).
* ``param``: parameter bytes including gradient and optimizer state, ``parameters *``
  :func:`state_bytes_per_param` (megatron's Adam without distributed optimizer). With tied
  embeddings the head also counts the output weight (vocab x hidden): in a pipeline the
  last stage keeps its own copy of the word embedding.
* ``grad``: the gradient bytes alone, ``parameters *`` :func:`grad_bytes_per_param` (what
  direction ``bi`` sums between the two weight replicas of a stage).
* ``message_bytes``: one activation between stages, ``seq * mbs * hidden * dtype size``.
* ``tied_grad_bytes`` (tied embeddings only): the tied weight's gradient bytes, which the
  first and last stages' copies sum after each step (:mod:`megatron_prt.sim.replica_sync`).
* the totals are the whole model (layers, embedding and head), one micro-batch.
* ``model``: the shape profiled (:mod:`megatron_prt.sim.model_shape`), which tune copies
  into plan files and the training flags are compared with.

Every layer is measured unless ``profile_layers`` is smaller than ``num_layers``: then a
model of ``profile_layers`` layers is profiled and the last profiled layer's costs are
repeated for the rest (megatron's layers are identical, so only timing noise differs).

The numbers are for the layer spec profiled: the local spec (the default, CPU and GPU)
materialises the ``mbs * heads * seq**2`` attention scores; the Transformer Engine spec
(``transformer_impl="transformer_engine"``, CUDA only) with fused / flash attention does not
save those. Only module structure is read (the embedding, the block's layers, hooks on
them), so both specs profile the same way.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from ..core.placement import ConfigError
from ..runtime.memory import ActivationMeter
from ..sim.model_shape import default_ffn
from ..sim.recompute import check_recompute
from .pretrain import (
    bert_forward_step,
    build_model,
    check_transformer_engine,
    pretrain_loss,
    random_batch,
    transformer_config,
)
from .profile_passes import Parts, Progress, block_checkpoints, time_passes, time_stage_work

KINDS = ("gpt", "bert")
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def state_bytes_per_param(dtype: torch.dtype) -> int:
    """Bytes a parameter costs in megatron training with Adam (no distributed optimizer):

    ========  =============================================================  =====
    params    what is kept                                                   bytes
    ========  =============================================================  =====
    float32   param 4 + main_grad 4 + exp_avg 4 + exp_avg_sq 4                  16
    bfloat16  param 2 + fp32 main_grad 4 (Megatron-LM accumulates bf16 grads
              in fp32) + fp32 main param 4 + exp_avg 4 + exp_avg_sq 4          18
    float16   param 2 + main_grad 2 + fp32 main param 4 + exp_avg 4
              + exp_avg_sq 4                                                    16
    float64   param, grad and both Adam moments in float64                     32
    ========  =============================================================  =====
    """
    table = {torch.float32: 16, torch.bfloat16: 18, torch.float16: 16, torch.float64: 32}
    if dtype not in table:
        raise ValueError(f"no parameter-state size for {dtype}; known: {sorted(map(str, table))}")
    return table[dtype]


def grad_bytes_per_param(dtype: torch.dtype) -> int:
    """Bytes of one parameter's gradient as training accumulates it (``main_grad``): fp32
    for float32 and bfloat16 parameters, the parameter's own size for float16 and float64
    (the gradient rows of :func:`state_bytes_per_param`)."""
    table = {torch.float32: 4, torch.bfloat16: 4, torch.float16: 2, torch.float64: 8}
    if dtype not in table:
        raise ValueError(f"no gradient size for {dtype}; known: {sorted(map(str, table))}")
    return table[dtype]


def profile_model(
    kind: str,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    seq_length: int,
    micro_batch_size: int,
    vocab_size: int,
    *,
    ffn_hidden_size: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    reps: int = 5,
    profile_layers: int | None = None,
    bytes_per_param: float | None = None,
    threads: int | None = None,
    seed: int = 1234,
    progress: Progress | None = None,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    transformer_impl: str = "local",
    split_backward: bool = True,
    hidden_dropout: float = 0.0,
    attention_dropout: float = 0.0,
) -> dict:
    """Cost JSON of one micro-batch of ``kind`` on ``device`` (see the module docstring;
    times in seconds, sizes in bytes). ``dtype``: a key of :data:`DTYPES`;
    ``bytes_per_param`` overrides :func:`state_bytes_per_param`; ``threads``: torch's CPU
    threads while profiling (a CPU pipeline rank runs one; ``None`` keeps the setting);
    ``progress`` receives one line per pass. ``recompute_*``: megatron's activation
    recomputation (same names and rules): the model is measured a second time with it on
    and every layer gets what it keeps and its backward time when recomputed (``full_act``
    / ``full_bwd``, a block of one layer, or ``selective_act`` / ``selective_bwd``); the
    setting is written into the result for the simulator and the partitioner to price.
    ``transformer_impl``: the layer spec (``transformer_engine`` needs ``device="cuda"`` and
    TE). ``split_backward``: also measure the split form (:func:`_add_split_form`).
    ``hidden_dropout`` / ``attention_dropout``: megatron's, as the training run sets them
    (dropout keeps its masks: more activation bytes per layer). Runs on
    one rank: it starts a one-rank process group if none exists (and ends it) and
    (re)initialises megatron's model-parallel state with one pipeline stage, so call it
    before, not inside, a multi-rank run. On CPU it installs
    :func:`megatron_prt.megatron.cpu.enable` (process-wide). (Over 60 lines for its
    signature, one keyword per ``megatron-prt profile`` flag, and this contract.)"""
    sizes = {
        "--num-layers": num_layers,
        "--hidden-size": hidden_size,
        "--num-attention-heads": num_attention_heads,
        "--ffn-hidden-size": ffn_hidden_size,
        "--seq-length": seq_length,
        "--micro-batch-size": micro_batch_size,
        "--vocab-size": vocab_size,
        "--reps": reps,
        "--profile-layers": profile_layers,
        "--threads": threads,
    }
    recompute = (recompute_granularity, recompute_method, recompute_num_layers)
    dropout = {"hidden_dropout": hidden_dropout, "attention_dropout": attention_dropout}
    _check(kind, sizes, dtype, device)
    _check_model_options(recompute, transformer_impl, device)
    torch_dtype = DTYPES[dtype]
    layers_built = min(num_layers, profile_layers or num_layers)
    say = progress or (lambda message: None)
    with _single_rank(device, seed), _cpu_threads(threads):
        sizes_built = (layers_built, hidden_size, ffn_hidden_size, num_attention_heads)
        config = _config_factory(torch_dtype, *sizes_built, device, dropout)
        shape = (seq_length, micro_batch_size, vocab_size, device)
        build = partial(build_model, kind, transformer_impl=transformer_impl)
        fwd, bwd, act, params = _measure(build, kind, config(), shape, reps, say)
        tied = params.pop("tied")
        costs = _part_costs(fwd, bwd, act, params, torch_dtype, bytes_per_param)
        if split_backward:  # as many passes again
            _add_split_form(costs, build, kind, config(), shape, reps, say)
        if recompute_granularity is not None:
            _add_recomputed(costs, recompute_granularity, build, kind, config, shape, reps, say)
        stage = _stage_work(build, kind, config(num_layers=1), shape, reps, say)
    message_bytes = seq_length * micro_batch_size * hidden_size * torch_dtype.itemsize
    result = _with_totals(
        _all_layers(costs, num_layers), costs["embedding"], costs["head"], message_bytes, stage
    )
    result["model"] = {**_shape(kind, sizes, dtype, transformer_impl, device), **dropout}
    if tied:  # the first and last stages' copies are summed after each step
        result["tied_grad_bytes"] = tied * grad_bytes_per_param(torch_dtype)
    if recompute_granularity is not None:
        names = ("recompute_granularity", "recompute_method", "recompute_num_layers")
        result.update(zip(names, recompute, strict=True))
    return result


def _all_layers(costs: dict, num_layers: int) -> list[dict]:
    """Every layer's entry: the profiled ones, then the last one's repeated (``profile_layers``)."""
    layers = [costs[i] for i in range(num_layers) if i in costs]
    return layers + [dict(layers[-1]) for _ in range(num_layers - len(layers))]


def _shape(kind: str, sizes: dict, dtype: str, transformer_impl: str, device: str) -> dict:
    """The cost file's ``model``, what the costs hold for: :mod:`~megatron_prt.sim.model_shape`."""
    shape = {"model": kind}
    for flag in ("--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--seq-length",
                 "--micro-batch-size", "--vocab-size"):  # fmt: skip
        shape[flag[2:].replace("-", "_")] = sizes[flag]
    shape["ffn_hidden_size"] = default_ffn(shape["ffn_hidden_size"], shape["hidden_size"])
    shape.update(dtype=dtype, transformer_impl=transformer_impl, device=device)
    shape["tensor_model_parallel_size"] = 1  # profiled on one rank
    # the profiled model: GELU MLP, one key/value head per query head
    shape.update(swiglu=False, untie_embeddings_and_output_weights=kind == "gpt-untied")
    shape["num_query_groups"] = shape["num_attention_heads"]
    return shape


def _config_factory(dtype, layers, hidden, ffn_hidden, heads, device: str, dropout=None):
    """A TransformerConfig maker with the test models' settings (no fused kernels, no
    dropout) and ``dropout`` (megatron's ``hidden_dropout`` and ``attention_dropout``); its
    keywords override them."""
    return partial(
        transformer_config,
        dtype,
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn_hidden,
        num_attention_heads=heads,
        use_cpu_initialization=device == "cpu",
        **(dropout or {}),
    )


def _add_recomputed(costs: dict, granularity: str, build, kind, config, shape, reps, say) -> None:
    """Measure the model again under ``granularity`` (``full``: every layer a block of one,
    sim/cost.py composes blocks) and add each layer's ``<granularity>_act`` / ``_bwd``."""
    fields = {"recompute_granularity": granularity}
    if granularity == "full":
        fields.update(recompute_method="uniform", recompute_num_layers=1)
    _, bwd, act, _ = _measure(build, kind, config(**fields), shape, reps, say)
    for part, cost in costs.items():
        if isinstance(part, int):  # a transformer layer: megatron recomputes only those
            cost[f"{granularity}_act"], cost[f"{granularity}_bwd"] = act[part], bwd[part]


def _add_split_form(costs: dict, build, kind, config, shape: tuple, reps: int, say) -> None:
    """Measure a fresh model in the split form (megatron's linear layers split-capable,
    :func:`~.profile_passes.time_passes` with ``split``; without recomputation) and add each part's
    ``split_fwd``, ``split_bwd`` (I + W) and ``wgrad`` (W): [Note: the split form's own
    costs] in :mod:`megatron_prt.sim.layer_cost`. Weight gradients the integration leaves
    in I (embeddings, norms, Transformer Engine layers) count in I, as they run."""
    from .split import enable_megatron_split_backward

    seq_length, micro_batch_size, vocab_size, device = shape
    model = build(config, vocab_size, seq_length)
    model.to(device=device, dtype=config.params_dtype)
    enable_megatron_split_backward([model])
    batch_shape = (seq_length, micro_batch_size, vocab_size)
    step = partial(_forward_step, kind, config, model, batch_shape, torch.device(device))
    parts = Parts(model, kind)
    try:
        split = time_passes(step, parts, reps, say, split=True)
    finally:
        parts.remove()
    for part, cost in costs.items():
        w = split["wgrad"][part]
        cost.update(split_fwd=split["fwd"][part], split_bwd=split["bwd"][part] + w, wgrad=w)
        cost["wact"] = split["wact"][part]


def _measure(build: Callable, kind: str, config, shape: tuple, reps: int, say: Progress):
    """``(fwd, bwd, act, params)`` per part of the model ``build(config, vocab, seq)`` makes
    (``kind``'s): median seconds, bytes held for backward, parameter counts."""
    seq_length, micro_batch_size, vocab_size, device = shape
    model = build(config, vocab_size, seq_length)
    model.to(device=device, dtype=config.params_dtype)
    batch_shape = (seq_length, micro_batch_size, vocab_size)
    step = partial(_forward_step, kind, config, model, batch_shape, torch.device(device))
    parts = Parts(model, kind)
    try:
        with block_checkpoints(parts, config.recompute_granularity == "full"):
            timed = time_passes(step, parts, reps, say)
            fwd, bwd = timed["fwd"], timed["bwd"]
            act = _activation_bytes(step, parts, model)
    finally:
        parts.remove()
    return fwd, bwd, act, _param_counts(model, parts)


def _part_costs(fwd, bwd, act, params, torch_dtype, bytes_per_param) -> dict:
    """Per profiled part (layer index, ``embedding``, ``head``): its cost entry."""
    per_param = bytes_per_param or state_bytes_per_param(torch_dtype)
    grad_per_param = grad_bytes_per_param(torch_dtype)
    costs = {
        name: {
            "fwd": fwd[name],
            "bwd": bwd[name],
            "act": act[name],
            "param": n * per_param,
            "grad": n * grad_per_param,
        }
        for name, n in params.items()
    }
    return costs


def _check(kind: str, sizes: dict, dtype: str, device: str) -> None:
    """Refuse bad settings before anything starts (flag names as the CLI spells them)."""
    if kind not in KINDS:
        raise ValueError(f"--model must be one of {', '.join(KINDS)}, got {kind!r}")
    for flag, value in sizes.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    hidden, heads = sizes["--hidden-size"], sizes["--num-attention-heads"]
    if heads >= 1 and hidden % heads:
        raise ValueError(
            f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads} (each "
            "head gets hidden/heads channels); change either so that it divides"
        )
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible; use --device cpu")
    if device == "cpu" and dtype in ("bfloat16", "float16"):
        raise ValueError("on CPU megatron runs in float32 (or float64) here; drop --bf16/--fp16")


def _check_model_options(recompute: tuple, transformer_impl: str, device: str) -> None:
    """megatron's recomputation rules and where the TE spec runs, before anything starts."""
    try:
        check_recompute(*recompute)
    except ConfigError as exc:
        raise ValueError(str(exc)) from exc
    if transformer_impl == "transformer_engine":
        if device != "cuda":
            raise ValueError(
                "--transformer-impl transformer_engine runs on --device cuda only (Transformer "
                "Engine has no CPU kernels); use --transformer-impl local on CPU"
            )
        check_transformer_engine()


def _stage_work(build: Callable, kind: str, config, shape: tuple, reps: int, say) -> dict:
    """The cost file's ``stage`` entry: what a middle chunk of one layer spends outside it
    in megatron's ``forward_step`` and its backward, timed as the pipeline runs a stage; the
    same work is taken out of the embedding's forward and the head's backward by
    :func:`_take_stage_work` ([Note: every stage pays its step's work] in
    :mod:`megatron_prt.sim.cost`)."""
    from megatron.core.pipeline_parallel import schedules

    seq_length, micro_batch_size, vocab_size, device = shape
    model = build(config, vocab_size, seq_length, pre_process=False, post_process=False)
    model.to(device=device, dtype=config.params_dtype)
    on = torch.device(device)

    batch = random_batch(vocab_size, micro_batch_size, seq_length, device=on)  # the loader's

    def step(chunk, hidden):
        step_fn = partial(_model_step, kind)
        out, _ = schedules.forward_step(
            step_fn, iter([batch]), chunk, 1, hidden, [], config, 1, is_last_stage=False
        )
        return out

    size = (seq_length, micro_batch_size, config.hidden_size)
    hidden = torch.randn(size, device=on, dtype=config.params_dtype)
    say(f"timing a middle stage's step work ({reps} passes)")
    fwd, bwd = time_stage_work(model, kind, step, hidden, reps)
    return {"fwd": fwd, "bwd": bwd, "act": 0.0, "param": 0.0, "grad": 0.0, "wgrad": 0.0}


def _take_stage_work(embedding: dict, head: dict, stage: dict) -> None:
    """Take ``stage``'s work out of the embedding's forward and the head's backward, where
    the one profiled pass put it (at most what they hold)."""
    for part, keys, work in ((embedding, ("fwd", "split_fwd"), stage["fwd"]),
                             (head, ("bwd", "split_bwd"), stage["bwd"])):  # fmt: skip
        for key in keys:
            if key in part:
                part[key] -= min(part[key], work)
    if "wgrad" in head and "split_bwd" in head:
        head["wgrad"] = min(head["wgrad"], head["split_bwd"])


def _with_totals(
    layers: list[dict], embedding: dict, head: dict, message_bytes: int, stage: dict
) -> dict:
    """The cost file: the parts (``stage``'s work out of the embedding and the head:
    :func:`_take_stage_work`), and the whole pass's totals (one step: ``stage`` once)."""
    _take_stage_work(embedding, head, stage)
    parts = [*layers, embedding, head, stage]
    return {
        "layers": layers,
        "embedding": embedding,
        "head": head,
        "stage": stage,
        "message_bytes": message_bytes,
        "fwd_time": sum(p["fwd"] for p in parts),
        "bwd_time": sum(p["bwd"] for p in parts),
        "activation_bytes": sum(p["act"] for p in parts),
        "param_bytes": sum(p["param"] for p in parts),
        "grad_bytes": sum(p["grad"] for p in parts),
    }


# -- one-rank megatron -----------------------------------------------------------------------
@contextlib.contextmanager
def _single_rank(device: str, seed: int) -> Iterator[None]:
    """A one-rank process group (started here unless one exists) and megatron's parallel
    state with one stage; the CPU shim on CPU."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    started = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        if started:
            dist.init_process_group(
                "gloo" if device == "cpu" else "nccl",
                init_method=f"file://{os.path.join(tmp, 'store')}",
                rank=0,
                world_size=1,
                timeout=timedelta(seconds=60),
            )
        elif dist.get_world_size() != 1:
            raise ValueError(
                f"profile_model runs on one rank; this process group has {dist.get_world_size()}"
            )
        try:
            if device == "cpu":
                from . import cpu

                cpu.enable()
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(pipeline_model_parallel_size=1)
            model_parallel_cuda_manual_seed(seed)
            torch.manual_seed(seed)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if started:
                dist.destroy_process_group()


@contextlib.contextmanager
def _cpu_threads(threads: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- one training micro-batch ------------------------------------------------------------------
def _forward_step(kind, config, model, shape, device) -> torch.Tensor:
    """One micro-batch through megatron's ``schedules.forward_step`` (as in training):
    the loss, scaled as megatron scales it. Fresh inputs every call."""
    from megatron.core.pipeline_parallel import schedules

    seq, mbs, vocab = shape
    batch = random_batch(vocab, mbs, seq, device=device)  # GPT reads tokens and labels only
    loss, _ = schedules.forward_step(
        partial(_model_step, kind),
        iter([batch]),
        model,
        1,
        None,
        [],
        config,
        1,
        is_last_stage=True,
    )
    return loss


def _model_step(kind: str, data_iterator, model):
    """megatron's ``forward_step_func`` contract: ``(output, loss_func)``."""
    if kind == "bert":
        return bert_forward_step(data_iterator, model)
    batch = next(data_iterator)
    tokens = batch["tokens"]
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    output = model(tokens, positions, None, labels=batch["labels"])
    return output, partial(pretrain_loss, batch)


def _activation_bytes(step, parts: Parts, model: torch.nn.Module) -> dict:
    """Bytes each part saves for backward in one micro-batch (first part to save a storage
    owns it; storages a second micro-batch saves again are caches and left out)."""
    params = list(model.parameters())
    meters, losses = [], []
    for _ in range(2):  # both graphs stay alive, so no address is reused between them
        meter = ActivationMeter(params)
        parts.current = "embedding"
        with meter.saving_for(lambda: parts.current):
            losses.append(step())
        meters.append(meter)
    first, second = meters
    cached = {key for name in parts.names() for key in second.storages(name)}
    seen: set = set()
    act = {}
    for name in parts.names():
        excluded = seen | cached
        mine = {k: b for k, b in first.storages(name).items() if k not in excluded}
        seen |= set(mine)
        act[name] = sum(mine.values())
    return act


def _param_counts(model: torch.nn.Module, parts: Parts) -> dict:
    """Parameters per part; the head also counts a tied output weight's copy, and
    ``"tied"`` (not a part) the tied weight's own count, 0 when untied."""
    counts: dict = {"embedding": _numel(parts.embedding)}
    for i, layer in enumerate(parts.layers):
        counts[i] = _numel(layer)
    counts["head"] = _numel(model) - sum(counts.values())
    counts["tied"] = 0
    if getattr(model, "share_embeddings_and_output_weights", False):
        counts["tied"] = model.shared_embedding_or_output_weight().numel()
        counts["head"] += counts["tied"]
    return counts


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
