"""Flags of ``megatron-prt bench`` (standard library only: the CLI registers them without
loading torch)."""

from __future__ import annotations

import argparse
import shlex

SECTIONS = ("all", "layers", "bert")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Register every bench flag on ``parser``."""
    parser.add_argument(
        "--model",
        choices=SECTIONS,
        default="all",
        help="layers: MLP layer stack vs torch.distributed.pipelining; bert: megatron-core "
        "BERT; all (default): both",
    )
    parser.add_argument(
        "--microbatches", default="1,2,8", help="comma-separated m values (default 1,2,8)"
    )
    parser.add_argument("--reps", type=int, default=21, help="timed repetitions (median)")
    parser.add_argument(
        "--out",
        default="out/bench",
        help="report, chart and data go here (default out/bench; the committed reports: "
        "--out docs/benchmarks)",
    )
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks P (local gloo)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    parser.add_argument("--burst", type=int, default=64, help="messages per CPU-cost burst")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny models and 1 repetition: checks it runs"
    )
    parser.add_argument(
        "--no-keep-freed-memory",
        dest="keep_freed_memory",
        action="store_false",
        help="leave glibc's default of returning large freed blocks to the OS",
    )
    layers = parser.add_argument_group("layer stack (--model layers)")
    layers.add_argument("--layers", type=int, default=8, help="Linear+GELU layers")
    layers.add_argument("--hidden", type=int, default=768, help="layer width")
    layers.add_argument("--mb-size", type=int, default=16, help="rows per micro-batch")
    layers.add_argument("--profile-steps", type=int, default=5, help="traced profiling steps")
    bert = parser.add_argument_group("megatron-core BERT (--model bert)")
    bert.add_argument("--bert-layers", type=int, default=8)
    bert.add_argument("--bert-hidden", type=int, default=128)
    bert.add_argument("--bert-heads", type=int, default=4)
    bert.add_argument("--bert-seq", type=int, default=64, help="tokens per sequence")
    bert.add_argument("--bert-mbs", type=int, default=4, help="sequences per micro-batch")
    bert.add_argument("--bert-vocab", type=int, default=1024)
    bert.add_argument("--bert-profile-reps", type=int, default=5, help="profiled passes")


def finish(args: argparse.Namespace) -> argparse.Namespace:
    """Parse ``--microbatches`` and apply ``--smoke``; raises ValueError naming the flag."""
    try:
        args.microbatches = [int(m) for m in str(args.microbatches).split(",")]
    except ValueError:
        raise ValueError(
            f"--microbatches: comma-separated integers, got {args.microbatches!r}"
        ) from None
    if min(args.microbatches) < 1 or args.reps < 1 or args.ranks < 2:
        raise ValueError("--microbatches and --reps must be >= 1 and --ranks >= 2")
    if args.smoke:
        args.hidden, args.mb_size, args.reps, args.warmup = 32, 2, 1, 1
        args.profile_steps, args.burst = 1, 4
        args.bert_hidden, args.bert_heads, args.bert_seq, args.bert_mbs = 16, 2, 8, 2
        args.bert_vocab, args.bert_profile_reps = 64, 1
    return args


def command_line(prog: str, args: argparse.Namespace) -> str:
    """``prog`` and the flags of ``args`` (before :func:`finish`) that differ from their
    defaults: the command to quote in a report."""
    parser = argparse.ArgumentParser()
    add_flags(parser)
    words = [prog]
    for dest, default in vars(parser.parse_args([])).items():
        value, flag = getattr(args, dest), "--" + dest.replace("_", "-")
        if value == default:
            continue
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, shlex.quote(str(value))]
    return " ".join(words)
