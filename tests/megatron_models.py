"""megatron-core models and data for the integration tests (CPU, gloo, float64).

A reference run (one rank, no pipelining, megatron's own no-pipelining schedule) and PRT runs
of the same model with the same weights; parameters are compared by *global* name (layer
numbers of the unpipelined model, :mod:`megatron_prt.megatron.weights`), so every chunk's
parameters find their reference.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from functools import partial

import torch
import torch.distributed as dist

from megatron_prt.megatron.weights import global_name, load_global

VOCAB, SEQ, MBS, HIDDEN = 64, 8, 2, 16
DTYPE = torch.float64
# Where models and batches live: the CPU (through megatron_prt.megatron.cpu) in the tests;
# scripts/gpu_megatron_parity.py sets a GPU.
DEVICE = torch.device("cpu")


def setup_megatron(pp: int, vp: int | None, tp: int = 1):
    from megatron_prt.megatron.pretrain import init_parallel_state

    init_parallel_state(pp, vp, on_cpu=DEVICE.type == "cpu", tensor=tp)


def transformer_config(num_layers: int, dtype: torch.dtype = DTYPE, **extra):
    from megatron_prt.megatron.pretrain import transformer_config as unfused_config

    fields = dict(num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4)
    return unfused_config(dtype, **{**fields, **extra})


def build_model(kind: str, config, pre_process=True, post_process=True, vp_stage=None):
    """``gpt`` (tied), ``gpt-untied``, ``bert`` (tied, binary head), ``bert-nobinary``."""
    from megatron_prt.megatron import pretrain

    default = torch.get_default_dtype()
    torch.set_default_dtype(config.params_dtype)  # the torch-norm fallback ignores params_dtype
    try:
        model = pretrain.build_model(kind, config, VOCAB, SEQ, pre_process, post_process, vp_stage)
        return model.to(DEVICE)
    finally:
        torch.set_default_dtype(default)


def model_chunks(kind: str, config, reuse=None) -> list:
    """This rank's chunks of ``kind`` for ``reuse`` (the whole model for ``None``), built by
    :func:`megatron_prt.megatron.build_chunks`."""
    from megatron_prt.megatron import build_chunks

    return build_chunks(partial(build_model, kind), reuse, config=config)


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


def step_kwargs(kind: str, model: list, m: int, per_token: bool = False, step: int = 0) -> dict:
    """megatron's forward-backward keywords for ``m`` micro-batches of ``kind`` (step
    ``step``'s batches) over the chunks ``model``."""
    return dict(
        forward_step_func=partial(forward_step, kind, per_token),
        data_iterator=[iter(batches(m, step)) for _ in model],
        model=model,
        num_microbatches=m,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )


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


def is_tied(kind: str) -> bool:
    return kind != "gpt-untied"


def reference(
    rank, world, kind, num_layers, m, per_token=False, variable=False, config=None, build=None
):
    """One rank, megatron's no-pipelining schedule: losses, grads and initial weights.
    ``config`` and ``build(kind, config)`` replace the tests' float64 config and model."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    setup_megatron(1, None)
    torch.manual_seed(7)
    config = config or transformer_config(num_layers, calculate_per_token_loss=per_token)
    model = (build or build_model)(kind, config)
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
    from megatron_prt.megatron.model import transformer_config_kwargs

    placement = reuse.placement
    setup_megatron(placement.ranks, placement.chunks_per_rank)
    config = transformer_config(
        calculate_per_token_loss=per_token, **transformer_config_kwargs(reuse)
    )
    config.variable_seq_lengths = variable  # set late: the constructor checks MoE settings
    model = model_chunks(kind, config, reuse)
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
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_prt.megatron import make_forward_backward_func
    from megatron_prt.megatron.model import transformer_config_kwargs
    from megatron_prt.megatron.training import build_training

    if reuse is None:
        setup_megatron(1, None)
        config = transformer_config(LAYERS_TRAIN, torch.float32)
        forward_backward = forward_backward_no_pipelining
    else:
        setup_megatron(reuse.placement.ranks, reuse.placement.chunks_per_rank)
        config = transformer_config(dtype=torch.float32, **transformer_config_kwargs(reuse))
        forward_backward = make_forward_backward_func(reuse, timeout_s=60)
    model = model_chunks(kind, config, reuse)
    load_global(model, ref_state, is_tied(kind))
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=LR, clip_grad=CLIP, weight_decay=0.0, adam_eps=EPS
    )
    training = build_training(model, config, optimizer_config=optimizer_config, reuse=reuse)
    model, optimizer = training.chunks, training.optimizer
    losses, norms = [], []
    for step in range(STEPS):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        store = forward_backward(**step_kwargs(kind, model, m, step=step))
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


def grad_buffer_reductions(chunks) -> tuple[list, list[int]]:
    """(patches, counts): while the patches are entered, ``counts[i]`` counts the data-parallel
    collectives (all-reduce or reduce-scatter) issued on gradient bucket ``i`` of ``chunks``'
    megatron DDP buffers."""
    import unittest.mock

    from megatron.core.distributed import param_and_grad_buffer

    buckets = [bucket for chunk in chunks for buffer in chunk.buffers for bucket in buffer.buckets]
    counts = [0] * len(buckets)

    def counting(collective):
        def call(tensor, *args, **kwargs):
            for i, bucket in enumerate(buckets):
                if tensor.data_ptr() == bucket.grad_data.data_ptr():
                    counts[i] += 1
            return collective(tensor, *args, **kwargs)

        return call

    def counting_scatter(collective):  # (output, input, ...): the bucket is the input
        def call(output, tensor, *args, **kwargs):
            counting(lambda *a, **k: None)(tensor)
            return collective(output, tensor, *args, **kwargs)

        return call

    scatter = param_and_grad_buffer.dist_reduce_scatter_func
    patches = [
        unittest.mock.patch.object(dist, "all_reduce", counting(dist.all_reduce)),
        unittest.mock.patch.object(
            param_and_grad_buffer, "dist_reduce_scatter_func", counting_scatter(scatter)
        ),
    ]
    return patches, counts


LAYERS_3D = 6


@contextlib.contextmanager
def _counting_recomputed_blocks(out: dict):
    """While open, ``out["recomputed"]`` counts blocks megatron checkpoints for recompute."""
    import unittest.mock

    from megatron.core.tensor_parallel import random

    forward = random.CheckpointFunction.forward

    def counted(ctx, *args, **kwargs):
        out["recomputed"] = out.get("recomputed", 0) + 1
        return forward(ctx, *args, **kwargs)

    with unittest.mock.patch.object(random.CheckpointFunction, "forward", staticmethod(counted)):
        yield


def parallel_train(
    rank,
    world,
    kind,
    tp,
    m,
    reuse=None,
    states=None,
    ddp=None,
    sp=False,
    dtype=DTYPE,
    ckpt=None,
    recompute=None,
):
    """STEPS steps of megatron's DDP + Adam in float64 (no clipping: megatron clips fp32 only;
    ``ddp``'s pseudo-field ``clip_grad`` clips an fp32 run) on TP x PP x DP ranks:
    megatron's no-pipelining schedule for ``reuse`` ``None`` (PP 1),
    else PRT. DP rank ``d`` trains on micro-batches ``d*m .. d*m+m-1`` of each step's
    ``m * DP``. ``states``: initial weights by TP rank (a reference run's ``state``);
    ``ddp``: ``DistributedDataParallelConfig`` fields. Returns this rank's TP / DP ranks,
    initial ``state``, per-step losses (where megatron reads them), per-step reduced grads,
    gradient norms (0 unless clipped) and counts of collectives per gradient bucket, and the
    final parameters.
    ``ckpt``: ``{"steps": (first, end), "load": dir, "save": dir}`` (each optional): train
    steps ``first .. end-1`` after loading a checkpoint, then save one. ``recompute``:
    megatron's ``recompute_granularity`` (``full``: every layer, ``uniform`` method)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_prt.megatron import make_forward_backward_func
    from megatron_prt.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megatron_prt.megatron.model import transformer_config_kwargs, unwrap
    from megatron_prt.megatron.training import build_training
    from megatron_prt.megatron.weights import local_state

    fields = dict(tensor_model_parallel_size=tp, sequence_parallel=sp)
    if recompute is not None:
        fields["recompute_granularity"] = recompute
    if recompute == "full":
        fields.update(recompute_method="uniform", recompute_num_layers=1)
    if reuse is None:
        setup_megatron(1, None, tp)
        config = transformer_config(LAYERS_3D, dtype, **fields)
        forward_backward = forward_backward_no_pipelining
    else:
        setup_megatron(reuse.placement.ranks, reuse.placement.chunks_per_rank, tp)
        config = transformer_config(dtype=dtype, **fields, **transformer_config_kwargs(reuse))
        forward_backward = make_forward_backward_func(reuse, timeout_s=120)
    tp_rank, dp = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    torch.manual_seed(7)
    model = model_chunks(kind, config, reuse)
    if states is not None:
        load_global(model, states[tp_rank], is_tied(kind))
    state = local_state(model, is_tied(kind))
    ddp = dict(ddp or {})
    align = ddp.pop("align_grad_reduce", False)  # Megatron-LM's flag, not a DDP field
    clip = ddp.pop("clip_grad", 0.0)  # an optimizer field
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=LR, clip_grad=clip, weight_decay=0.0, adam_eps=EPS,
        params_dtype=dtype, use_distributed_optimizer=bool(ddp.get("use_distributed_optimizer")),
    )  # fmt: skip
    ddp_config = DistributedDataParallelConfig(**{"overlap_grad_reduce": False, **ddp})
    training = build_training(
        model, config, optimizer_config=optimizer_config, ddp_config=ddp_config, reuse=reuse
    )
    if align:  # as Megatron-LM's train() sets it under --overlap-grad-reduce
        training.config.grad_sync_func = [chunk.start_grad_sync for chunk in training.chunks]
    model, optimizer = training.chunks, training.optimizer
    ckpt = ckpt or {}
    if ckpt.get("load"):
        assert load_checkpoint(ckpt["load"], model, optimizer) == ckpt["steps"][0]
    out = {"tp": tp_rank, "dp": dp_rank, "state": state, "losses": [], "grads": [], "counts": []}
    out["norms"] = []
    out["sent_shapes"] = sent = set()  # output shapes of chunks that send on (not the last)
    for chunk in model:
        if not unwrap(chunk).post_process:
            unwrap(chunk).register_forward_hook(lambda m, i, o: sent.add(tuple(o.shape)))
    for step in range(*ckpt.get("steps", (0, STEPS))):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        mine = batches(m * dp, step)[dp_rank * m : (dp_rank + 1) * m]
        patches, counts = grad_buffer_reductions(model)
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            stack.enter_context(_counting_recomputed_blocks(out))
            store = forward_backward(
                forward_step_func=partial(forward_step, kind, False),
                data_iterator=[iter(mine) for _ in model],
                model=model,
                num_microbatches=m,
                seq_length=SEQ,
                micro_batch_size=MBS,
            )
        out["counts"].append(counts)
        out["losses"].append([float(s["lm loss"]) for s in store])
        out["grads"].append(grads_by_name(model, is_tied(kind)))
        ok, norm, _ = optimizer.step()
        assert ok
        out["norms"].append(float(norm or 0.0))
    out["params"] = params_by_name(model, is_tied(kind))
    if ckpt.get("save"):
        # torch_dist writes through forked writer processes; run_local's ranks are daemonic
        # (torchrun's are not), and a daemonic process may not fork children
        multiprocessing.current_process()._config["daemon"] = False
        kept = optimizer if ckpt.get("save_optimizer", True) else None
        save_checkpoint(ckpt["save"], model, kept, ckpt["steps"][1])
    return out


def assert_tracks_reference(results: list[dict], want: dict, tol: dict) -> None:
    """Training ``results`` (one dict per rank: ``losses``, ``norms``, ``params`` by global
    name) against the unpipelined run ``want``: the last rank's losses, and every rank's
    gradient norms (megatron all-reduces them over the pipeline) and parameters."""
    torch.testing.assert_close(
        torch.tensor(results[-1]["losses"]), torch.tensor(want["losses"]), **tol
    )
    for rank, result in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(result["norms"]), torch.tensor(want["norms"]), **tol
        )
        for name, values in result["params"].items():
            for value in values:
                torch.testing.assert_close(
                    value, want["params"][name][0], **tol, msg=f"rank {rank}: {name}"
                )
