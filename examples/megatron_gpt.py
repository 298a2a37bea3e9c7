"""Train a megatron-core GPT with PRT: the megatron-core API of megatron-prt.

    torchrun --nproc-per-node 2 examples/megatron_gpt.py \\
        --pipeline-model-parallel-size 2 --pipeline-reuse 2 --pipeline-reuse-placement wave
    torchrun --nproc-per-node 8 examples/megatron_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --pipeline-reuse 2   # and data-parallel size 2

Megatron-LM flag names and meanings; the model, DDP, optimizer, gradient clipping and
finalize step are megatron-core's own; megatron-prt supplies the layer layout, the chunks'
roles, and the forward-backward function megatron looks up. On CPU (the default here) it runs
with gloo through :mod:`megatron_prt.megatron.cpu`; with ``--device cuda`` on NCCL, one GPU
per rank (``--distributed-backend gloo`` lets several ranks share a GPU: rank i uses GPU i mod
the GPU count, and activations cross through host shared memory).
Without ``--pipeline-reuse`` the same script runs megatron's own schedule for comparison
(``--pipeline-model-parallel-size 1`` on CPU); its speed and the trend of its loss compare,
not the loss itself: the weights draw from a seed per pipeline rank (Megatron-LM's rule), so
another pipeline size starts from other weights. The printed loss is the global batch's
(every data-parallel rank's micro-batches).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("model and training (Megatron-LM names)")
    group.add_argument("--num-layers", type=int, default=8)
    group.add_argument("--hidden-size", type=int, default=64)
    group.add_argument("--num-attention-heads", type=int, default=4)
    group.add_argument("--seq-length", type=int, default=32)
    group.add_argument("--vocab-size", type=int, default=128)
    group.add_argument("--micro-batch-size", type=int, default=2)
    group.add_argument("--global-batch-size", type=int, default=8)
    group.add_argument("--train-iters", type=int, default=5)
    group.add_argument("--lr", type=float, default=1e-3)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    group.add_argument(
        "--distributed-backend",
        choices=("nccl", "gloo"),
        help="default: nccl with --device cuda, gloo on CPU",
    )
    from megatron_prt.core import ConfigError
    from megatron_prt.megatron.args import add_arguments, validate_args

    group.add_argument("--seed", type=int, default=1234)
    add_arguments(parser)
    args = parser.parse_args()
    args.world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.context_parallel_size = 1
    try:
        args.reuse = validate_args(args)  # impossible settings stop here, before any collective
    except ConfigError as exc:
        refuse(parser, str(exc))
    model_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % model_size:
        refuse(
            parser,
            f"{args.world_size} process(es) do not divide into tensor x pipeline = "
            f"{model_size}; run under torchrun --nproc-per-node N, N a multiple of it",
        )
    per_step = args.micro_batch_size * (args.world_size // model_size)
    if args.global_batch_size % per_step:
        refuse(
            parser,
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"--micro-batch-size x data-parallel size = {per_step}",
        )
    if args.reuse is None and args.pipeline_model_parallel_size > 1 and args.device == "cpu":
        refuse(
            parser,
            "megatron's own pipeline schedule needs CUDA p2p: add --pipeline-reuse R "
            "(R = 1 is its 1F1B order) or --device cuda",
        )
    return args


def refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """argparse's error, printed by rank 0 only (every rank stops, status 2)."""
    if int(os.environ.get("RANK", "0")) == 0:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def build(args, reuse):
    """This rank's model chunks: megatron's own GPTModel (local spec,
    :func:`megatron_prt.megatron.pretrain.build_model`), chunk roles from the placement."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_prt.megatron import build_chunks, transformer_config_kwargs
    from megatron_prt.megatron.pretrain import build_model

    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        use_cpu_initialization=args.device == "cpu",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=args.device == "cuda",
        masked_softmax_fusion=args.device == "cuda",
        bias_dropout_fusion=args.device == "cuda",
        persist_layer_norm=False,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    if reuse is not None:
        fields.update(transformer_config_kwargs(reuse))
    config = TransformerConfig(**fields)
    kind = "gpt-untied" if args.untie_embeddings_and_output_weights else "gpt"
    provider = partial(build_model, kind, vocab_size=args.vocab_size, seq_length=args.seq_length)
    return config, build_chunks(provider, reuse, config=config)


def data(args, microbatches: int, step: int):
    """A synthetic language: each token is the previous one plus one (learnable quickly)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, args.vocab_size, (microbatches, args.micro_batch_size, 1), generator=g)
    tokens = (start + torch.arange(args.seq_length + 1)) % args.vocab_size
    return [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


def forward_step(args, device, data_iterator, model):
    batch = next(data_iterator)
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    pos = torch.arange(args.seq_length, device=device).expand_as(tokens)
    out = model(tokens, pos, None, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return out, loss_func


def init_device(args) -> torch.device:
    """Process group (NCCL on CUDA, gloo on CPU) and this rank's device."""
    device = torch.device(args.device)
    backend = args.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        )
        torch.cuda.set_device(device)
    elif backend != "gloo":
        raise SystemExit("--device cpu needs --distributed-backend gloo")
    # before the group starts: [Note: the default group must end with destroy_process_group]
    import megatron_prt.runtime  # noqa: F401

    dist.init_process_group(backend)
    if device.type == "cpu":
        torch.set_num_threads(1)
        from megatron_prt.megatron import cpu

        cpu.enable()
    return device


def setup_training(args, device):
    """megatron's parallel state, the model chunks in DDP with their optimizer
    (:func:`megatron_prt.megatron.training.build_training`) and PRT installed when used."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_prt.megatron as prt
    from megatron_prt.megatron.training import build_training

    reuse = args.reuse
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size
        if reuse
        else None,
        get_embedding_ranks=prt.embedding_ranks if reuse else None,
    )
    # Megatron-LM's rule: another seed per pipeline rank (the CPU initialization draws from
    # torch's generator, the tensor-parallel regions from the tracker)
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config, model = build(args, reuse)
    model = [chunk.to(device) for chunk in model]
    optimizer_config = OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=args.clip_grad)
    training = build_training(model, config, optimizer_config=optimizer_config, reuse=reuse)
    if reuse is not None:
        prt.install(reuse)  # megatron's get_forward_backward_func now returns PRT's
    return training


def train(args: argparse.Namespace, device: torch.device) -> None:
    """``args.train_iters`` iterations, printing each one's loss on the logging rank."""
    from megatron.core import parallel_state, pipeline_parallel

    training = setup_training(args, device)
    model, optimizer = training.chunks, training.optimizer
    dp = parallel_state.get_data_parallel_world_size()
    microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    forward_backward = pipeline_parallel.get_forward_backward_func()  # looked up after install
    last_rank = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()  # TP ranks share the loss
    if dist.get_rank() == 0:
        schedule = "megatron" if args.reuse is None else args.reuse.describe()
        print(
            f"schedule {schedule}; tensor {args.tensor_model_parallel_size} x pipeline "
            f"{args.pipeline_model_parallel_size} x data {dp}, {microbatches} micro-batches "
            "per iteration",
            flush=True,
        )
    for step in range(args.train_iters):
        start = time.perf_counter()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        # every data-parallel rank its own micro-batches of the step's global batch
        dp_rank = parallel_state.get_data_parallel_rank()
        batches = data(args, microbatches * dp, step)[dp_rank * microbatches :][:microbatches]
        losses = forward_backward(
            forward_step_func=lambda it, m: forward_step(args, device, it, m),
            data_iterator=[iter(batches) for _ in model],
            model=model,
            num_microbatches=microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
        )
        _, grad_norm, _ = optimizer.step()
        if last_rank:  # the global batch's mean: every data-parallel rank's micro-batches
            total = torch.tensor(
                [sum(float(x["lm loss"]) for x in losses), len(losses)], device=device
            )
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
            loss = float(total[0] / total[1])
        if last_rank and parallel_state.get_data_parallel_rank() == 0 and tp_rank == 0:
            print(
                f"iteration {step + 1}/{args.train_iters}: lm loss {loss:.6f} "
                f"grad norm {grad_norm:.4f} time {time.perf_counter() - start:.3f} s",
                flush=True,
            )


def main() -> None:
    args = parse_args()
    train(args, init_device(args))
    from megatron_prt.megatron import teardown  # megatron is loaded by now

    teardown()  # train's model, PRT's runtimes, megatron's groups, every process group


if __name__ == "__main__":
    main()
