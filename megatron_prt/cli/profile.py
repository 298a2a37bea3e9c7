"""``megatron-prt profile``: measure a megatron-core model's per-layer costs as cost JSON.

Flags follow Megatron-LM's names. The JSON (see :mod:`megatron_prt.megatron.profile`) goes
to ``-o FILE`` (a summary table to stdout) or, without ``-o``, to stdout (the summary to
stderr). Progress goes to stderr. Needs torch and megatron-core; they are imported only
when the command runs, so the rest of the CLI stays light.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..core.placement import ConfigError
from ..sim.model_shape import dtype_name
from .main import check_output, positive_int, probability, recompute_flags

LAYER_ROWS = 8  # more layers are summarised by their mean
SUMMARY_HEADER = f"{'part':<10} {'fwd ms':>9} {'bwd ms':>9} {'act MiB':>10} {'param MiB':>10}"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``profile`` on an ``add_subparsers()`` object; returns its parser."""
    p = subparsers.add_parser(
        "profile",
        help="measure per-layer time, activation and parameter bytes of a megatron-core model",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", choices=("gpt", "bert"), default="gpt")
    p.add_argument("--num-layers", type=positive_int, required=True)
    p.add_argument("--hidden-size", type=positive_int, required=True)
    p.add_argument("--num-attention-heads", type=positive_int, required=True)
    p.add_argument("--ffn-hidden-size", type=positive_int, default=None, help="default 4 x hidden")
    p.add_argument("--seq-length", type=positive_int, required=True)
    p.add_argument("--micro-batch-size", type=positive_int, required=True)
    p.add_argument("--vocab-size", type=positive_int, required=True)
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bfloat16 parameters (CUDA)")
    precision.add_argument("--fp16", action="store_true", help="float16 parameters (CUDA)")
    p.add_argument("--reps", type=positive_int, default=5, help="timed passes (median); default 5")
    p.add_argument(
        "--profile-layers",
        type=positive_int,
        default=None,
        help="profile only this many layers and repeat the last one's costs (big models)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="CPU threads (default 1, as each CPU pipeline rank runs)",
    )
    p.add_argument(
        "--comm",
        choices=("auto", "shm", "torch", "nccl", "none"),
        default=None,
        help="also measure a stage-boundary hop and the bi replica-gradient sum on two local "
        "gloo ranks over this transport (p2p_* and replica_* keys), or with nccl between "
        "GPUs 0 and 1 over NCCL; default auto on --device cpu, none on cuda",
    )
    p.add_argument(
        "--message-cpu",
        choices=("in-place", "none"),
        default=None,
        help="with --comm: also fit the rank time a message costs while both ranks compute "
        "(p2p_cpu) from a few- and a many-message step of a stand-in stack on that transport "
        "(see docs/tune.md); none leaves p2p_cpu out (0 when the tuner reads the file); "
        "default in-place on the host transports, none over nccl",
    )
    _dropout_flags(p)
    p.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default="local",
        help="layer spec (Megatron-LM's flag): transformer_engine needs --device cuda and TE",
    )
    p.add_argument(
        "--no-split-backward",
        dest="split_backward",
        action="store_false",
        help="skip the split-form passes (the split_fwd / split_bwd / wgrad keys: what the "
        "forward and I + W cost when the backward is split); the tuner then prices split "
        "backward at the whole backward's times, W half of it",
    )
    recompute_flags(
        p,
        "measure the layers a second time with megatron's recomputation on "
        "and write the full_* / selective_* keys (default: off)",
    )
    p.add_argument(
        "-o", "--output", "--out", dest="out", metavar="FILE", help="write the cost JSON here"
    )  # --output as tune and plan spell it; --out kept for older scripts
    p.set_defaults(func=run)
    return p


def _dropout_flags(p: argparse.ArgumentParser) -> None:
    for flag in ("--hidden-dropout", "--attention-dropout"):
        p.add_argument(
            flag,
            type=probability,
            default=0.1,
            help="megatron's, as training sets it (default 0.1, Megatron-LM's): dropout keeps "
            "a mask per activation, so it changes the bytes a layer holds; the cost file "
            "records it and a run under another is warned",
        )


def run(args: argparse.Namespace) -> int:
    """Profile, write the JSON, print the summary; 0, or 2 with one error line."""
    try:
        check_output(args.out, "costs.json")
        _check_comm(args)
        costs = _profile(args)
        costs.update(_measure_comm(args, costs))
    except (ValueError, RuntimeError, ImportError, AssertionError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"megatron-prt: error: {message}", file=sys.stderr)  # as every command
        return 2
    text = json.dumps(costs, indent=1) + "\n"
    summary = sys.stderr
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        summary = sys.stdout
    else:
        sys.stdout.write(text)
    print(format_summary(costs), file=summary)
    if args.out:
        print(f"wrote {args.out}", file=summary)
    return 0


def _profile(args: argparse.Namespace) -> dict:
    from ..megatron.profile import profile_model
    from ..runtime.cpu import keep_freed_memory

    if args.device == "cpu":
        keep_freed_memory()  # as CPU ranks run: no page faults from re-allocating activations
    dtype = dtype_name(args.bf16, args.fp16)
    return profile_model(
        args.model,
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.seq_length,
        args.micro_batch_size,
        args.vocab_size,
        ffn_hidden_size=args.ffn_hidden_size,
        dtype=dtype,
        device=args.device,
        reps=args.reps,
        profile_layers=args.profile_layers,
        threads=args.threads if args.device == "cpu" else None,
        progress=lambda message: print(message, file=sys.stderr, flush=True),
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        transformer_impl=args.transformer_impl,
        split_backward=args.split_backward,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
    )


COMM_GRAD_BYTES_CAP = 256 << 20  # the replica sum is timed on at most this many bytes


def _transport(args: argparse.Namespace) -> str:
    return args.comm or ("auto" if args.device == "cpu" else "none")


def _in_place(args: argparse.Namespace) -> bool:
    """Whether ``p2p_cpu`` is fitted in place (``--message-cpu``; its default per transport)."""
    default = "none" if _transport(args) == "nccl" else "in-place"
    return (args.message_cpu or default) == "in-place"


def _check_comm(args: argparse.Namespace) -> None:
    """Refuse a ``--comm`` that cannot run here, or a ``--message-cpu in-place`` with no
    transport to fit it on (it was ignored), before the model is profiled."""
    if _transport(args) == "none" and args.message_cpu == "in-place":
        implied = "" if args.comm else f" (--device {args.device} times no transport by default)"
        raise ConfigError(
            f"--message-cpu in-place fits the message CPU on the transport --comm times, and "
            f"none is timed{implied}: give --comm auto|shm|torch|nccl, or drop --message-cpu"
        )
    if _transport(args) == "nccl":
        from ..runtime.comm_timing import comm_backend

        comm_backend("nccl", _in_place(args))


def _measure_comm(args: argparse.Namespace, costs: dict) -> dict:
    """The measured message keys (:mod:`megatron_prt.runtime.comm_timing`), or none."""
    transport = _transport(args)
    if transport == "none":
        return {}
    from ..runtime.comm_timing import measure_comm

    in_place = _in_place(args)
    what = "a hop, the replica sum" + (" and the message CPU in place" if in_place else "")
    where = "GPUs 0 and 1" if transport == "nccl" else "2 ranks"
    print(f"timing {what} on {where} ({transport})", file=sys.stderr)
    parts = [*costs["layers"], costs["embedding"], costs["head"]]
    grads = sum(part.get("grad", part["param"] / 4) for part in parts)
    grad_bytes = int(min(grads / 2, COMM_GRAD_BYTES_CAP))  # one rank's half of P=2
    message_bytes = int(costs["message_bytes"])
    return measure_comm(message_bytes, max(grad_bytes, 1), transport, args.reps, in_place)


def format_summary(costs: dict) -> str:
    """Embedding, layers (one row each up to :data:`LAYER_ROWS`, else their mean), head,
    the work every stage's step adds and the whole model (one pass: that work once); times
    in ms, sizes in MiB."""
    layers = costs["layers"]
    if len(layers) <= LAYER_ROWS:
        rows = [(f"layer {i}", layer) for i, layer in enumerate(layers)]
    else:
        mean = {key: sum(layer[key] for layer in layers) / len(layers) for key in layers[0]}
        rows = [(f"layer x{len(layers)}", mean)]
    rows = [("embedding", costs["embedding"]), *rows, ("head", costs["head"])]
    if "stage" in costs:  # [Note: every stage pays its step's work] in sim/cost.py
        rows.append(("each stage", costs["stage"]))
    total = {
        "fwd": costs["fwd_time"],
        "bwd": costs["bwd_time"],
        "act": costs["activation_bytes"],
        "param": costs["param_bytes"],
    }
    rule = "-" * len(SUMMARY_HEADER)
    lines = [SUMMARY_HEADER, rule, *(_row(name, part) for name, part in rows), rule]
    lines.append(_row("total", total))
    lines.append(f"message between stages: {costs['message_bytes'] / 2**20:.3f} MiB")
    granularity = costs.get("recompute_granularity")
    if granularity is not None:  # what a recomputed layer keeps and costs (mean over layers)
        act = sum(layer[f"{granularity}_act"] for layer in layers) / len(layers)
        bwd = sum(layer[f"{granularity}_bwd"] for layer in layers) / len(layers)
        lines.append(
            f"recomputed layer ({granularity}): bwd {bwd * 1e3:.3f} ms, act {act / 2**20:.3f} MiB"
        )
    if "split_bwd" in layers[0]:  # the split form's own costs, summed over the parts
        parts = [costs["embedding"], *layers, costs["head"]]
        stage = costs.get("stage", {})  # the same in the split form, no W
        step_work = {"split_fwd": stage.get("fwd", 0.0), "split_bwd": stage.get("bwd", 0.0)}
        fwd, bwd, w = (
            sum(part[key] for part in parts) + step_work.get(key, 0.0)
            for key in ("split_fwd", "split_bwd", "wgrad")
        )
        lines.append(
            f"split backward: fwd {fwd * 1e3:.3f} ms, I + W {bwd * 1e3:.3f} ms of which W "
            f"{w * 1e3:.3f} ms ({w / bwd if bwd else 0:.0%}); whole backward "
            f"{costs['bwd_time'] * 1e3:.3f} ms"
        )
    if "p2p_latency" in costs:
        lines.append(_comm_row("hop", costs["p2p_latency"], costs["p2p_bandwidth"]))
        lines.append(_comm_row("replica sum", costs["replica_latency"], costs["replica_bandwidth"]))
    if "p2p_cpu" in costs:
        lines.append(f"message CPU while ranks compute: {costs['p2p_cpu'] * 1e6:.1f} us")
    return "\n".join(lines)


def _comm_row(name: str, latency: float, bandwidth: float | None) -> str:
    rate = "free" if bandwidth is None else f"{bandwidth / 2**30:.3g} GiB/s"
    return f"{name}: latency {latency * 1e6:.1f} us, bandwidth {rate}"


def _row(name: str, part: dict) -> str:
    return (
        f"{name:<10} {part['fwd'] * 1e3:>9.3f} {part['bwd'] * 1e3:>9.3f} "
        f"{part['act'] / 2**20:>10.3f} {part['param'] / 2**20:>10.3f}"
    )
