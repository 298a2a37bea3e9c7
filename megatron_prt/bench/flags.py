"""Flags of ``megatron-prt bench`` (standard library only: the CLI registers them without
loading torch)."""

from __future__ import annotations

import argparse
import shlex

SECTIONS = ("all", "layers", "bert")


def at_least(low: int):
    """An argparse type: an integer >= ``low`` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


# what --smoke sets: tiny models and one repetition (flags given on the command line stay)
SMOKE = {
    "hidden": 32, "mb_size": 2, "reps": 1, "warmup": 1, "profile_steps": 1, "burst": 4,
    "bert_hidden": 16, "bert_heads": 2, "bert_seq": 8, "bert_mbs": 2, "bert_vocab": 64,
    "bert_profile_reps": 1,
}  # fmt: skip


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
    parser.add_argument("--reps", type=at_least(1), default=21, help="timed repetitions (median)")
    parser.add_argument(
        "--out",
        default="out/bench",
        help="report, chart and data go here (default out/bench; the committed reports: "
        "--out docs/benchmarks)",
    )
    parser.add_argument(
        "--ranks", type=at_least(2), default=2, help="pipeline ranks P (local gloo)"
    )
    parser.add_argument(
        "--warmup", type=at_least(0), default=2, help="untimed steps per configuration"
    )
    parser.add_argument("--burst", type=at_least(1), default=64, help="messages per CPU-cost burst")
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
    layers.add_argument("--layers", type=at_least(1), default=8, help="Linear+GELU layers")
    layers.add_argument("--hidden", type=at_least(1), default=768, help="layer width")
    layers.add_argument("--mb-size", type=at_least(1), default=16, help="rows per micro-batch")
    layers.add_argument(
        "--profile-steps", type=at_least(1), default=5, help="traced profiling steps"
    )
    bert = parser.add_argument_group("megatron-core BERT (--model bert)")
    bert.add_argument("--bert-layers", type=at_least(1), default=8)
    bert.add_argument("--bert-hidden", type=at_least(1), default=128)
    bert.add_argument("--bert-heads", type=at_least(1), default=4)
    bert.add_argument("--bert-seq", type=at_least(1), default=64, help="tokens per sequence")
    bert.add_argument("--bert-mbs", type=at_least(1), default=4, help="sequences per micro-batch")
    bert.add_argument("--bert-vocab", type=at_least(1), default=1024)
    bert.add_argument("--bert-profile-reps", type=at_least(1), default=5, help="profiled passes")


def finish(args: argparse.Namespace) -> argparse.Namespace:
    """Parse ``--microbatches`` and apply ``--smoke``; raises ValueError naming the flag."""
    try:
        args.microbatches = [int(m) for m in str(args.microbatches).split(",")]
    except ValueError:
        raise ValueError(
            f"--microbatches: comma-separated integers, got {args.microbatches!r}"
        ) from None
    if min(args.microbatches) < 1:
        raise ValueError(f"--microbatches: each must be >= 1, got {args.microbatches}")
    if args.smoke:
        parser = argparse.ArgumentParser()
        add_flags(parser)
        apply_smoke(args, parser, SMOKE)
    return args


def apply_smoke(args: argparse.Namespace, parser: argparse.ArgumentParser, values: dict) -> None:
    """``--smoke``'s ``values`` on the flags of ``args`` left at ``parser``'s defaults: a flag
    given on the command line is what runs (and what the report's command line quotes); one
    given as its default value cannot be told from a default, and takes the smoke value."""
    for dest, value in values.items():
        if getattr(args, dest) == parser.get_default(dest):
            setattr(args, dest, value)


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
