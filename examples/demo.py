"""The one-command demo (``make demo``): BERT pretraining with PRT against 1F1B, side by side.

    python examples/demo.py [--out out/demo] [--ranks 4] [--train-iters 30]
    python examples/demo.py compare RUN.log BASELINE.log     # any two pretrain_bert.py runs

Prepares the corpus embedded in Python (``pydoc_data.topics``, no download) with a 1024-piece
SentencePiece tokenizer (``examples/bert_data.py``), then trains the same small BERT twice
with ``examples/pretrain_bert.py`` under ``torchrun --standalone`` on CPU ranks (one thread
each): PRT with ``--pipeline-reuse 2 --pipeline-reuse-placement wave`` and PRT's
1F1B-equivalent plan (``--pipeline-reuse 1``). Prints both runs' output, a table of
iteration time, speedup, measured and predicted bubble, per-rank peak activation memory and
final losses, and writes each run's first-iteration timeline (``OUT/prt.png``,
``OUT/1f1b.png``, Chrome traces beside).

``make demo`` runs 4 ranks, or one per core on a machine with fewer cores (``make demo
DEMO_RANKS=4`` forces 4): ranks that share a core time-slice, the table says so, and its
speed ratios are then not those of one device per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 1024  # a small output layer keeps the last stage from dominating the pipeline

# Small enough for 4 ranks on 2 cores in about a minute per run; 8 layers fill R*P = 8 stages.
MODEL_ARGS = (
    "--hidden-size 256 --num-attention-heads 4 --seq-length 64 "
    "--micro-batch-size 4 --global-batch-size 32 --lr 1e-3 --lr-warmup-iters 2 "
    "--min-lr 1e-4 --lr-decay-style cosine --eval-interval 10 --eval-iters 1 --log-interval 5"
).split()
RUNS = (  # (name, schedule flags)
    ("prt", ["--pipeline-reuse", "2", "--pipeline-reuse-placement", "wave"]),
    ("1f1b", ["--pipeline-reuse", "1"]),
)


def prepare_data(out: Path) -> tuple[str, str]:
    """``(dataset prefix, vocab file)`` of the embedded corpus under ``out`` (prepared once)."""
    sys.path.insert(0, str(HERE))
    import bert_data

    marker = out / "prepared.json"
    if not marker.is_file():
        prepared = bert_data.prepare(out, vocab_size=VOCAB_SIZE)
        marker.write_text(json.dumps({"prefix": prepared.prefix, "vocab": prepared.vocab_file}))
    paths = json.loads(marker.read_text())
    return paths["prefix"], paths["vocab"]


def run_training(name: str, command: list[str]) -> dict:
    """Run one launch, echo its output prefixed by ``[name]``, return its SUMMARY."""
    print(f"\n$ {' '.join(command)}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as process:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if not line.startswith("SUMMARY "):
                print(f"[{name}] {line}", end="", flush=True)
    if process.returncode != 0:
        raise SystemExit(f"demo: the {name} run failed (exit status {process.returncode})")
    return summary_of(lines)


def summary_of(lines: Sequence[str]) -> dict:
    """The JSON of the last ``SUMMARY {...}`` line."""
    found = [line for line in lines if line.startswith("SUMMARY ")]
    if not found:
        raise ValueError("no SUMMARY line: did the run finish?")
    return json.loads(found[-1][len("SUMMARY ") :])


def read_summary(path: str) -> dict:
    """A run's summary from its log (the ``SUMMARY`` line) or from a JSON file."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        return json.loads(text)
    return summary_of(text.splitlines())


def _mib(values: list[int] | None) -> str:
    return " ".join(f"{v / 2**20:.2f}" for v in values) if values else "n/a"


def _pct(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "n/a"


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "n/a"


def compare_summaries(run: dict, baseline: dict) -> str:
    """A side-by-side table of two pretrain_bert.py summaries; speedup is baseline time
    over run time. Ends with a caveat when ranks outnumber the CPU cores."""
    columns = [run, baseline]
    speedup = [baseline["ms_per_iteration"] / s["ms_per_iteration"] for s in columns]
    rows = [
        ("schedule", [s["schedule"] for s in columns]),
        ("ms per iteration (last half)", [_num(s["ms_per_iteration"], ".1f") for s in columns]),
        ("speedup vs baseline", [f"{x:.3f}x" for x in speedup]),
        ("bubble, measured", [_pct(s["bubble"]) for s in columns]),
        ("bubble, simulator (uniform)", [_pct(s["predicted_bubble"]) for s in columns]),
        ("peak activation MiB per rank", [_mib(s["peak_activation_bytes"]) for s in columns]),
        ("final lm loss", [_num(s["lm_loss"], ".4f") for s in columns]),
        ("final sop loss", [_num(s["sop_loss"], ".4f") for s in columns]),
        ("validation lm loss", [_num((s["valid"] or {}).get("lm loss"), ".4f") for s in columns]),
    ]
    label = max(len(name) for name, _ in rows)
    widths = [max(len(values[i]) for _, values in rows) for i in range(2)]
    lines = [
        f"{run['world_size']} {run['device']} ranks (pipeline {run['pipeline_model_parallel_size']}"
        f" x data {run['data_parallel_size']}), {run['num_microbatches']} micro-batches per "
        f"iteration, {run['iteration']} iterations"
    ]
    for name, values in rows:
        cells = "  ".join(v.rjust(w) for v, w in zip(values, widths, strict=True))
        lines.append(f"{name.ljust(label)}  {cells}")
    for s in columns:
        if s.get("trace"):
            lines.append(f"timeline of {s['schedule']}'s first iteration: {', '.join(s['trace'])}")
    lines.extend(_caveats(run))
    return "\n".join(lines)


def _caveats(run: dict) -> list[str]:
    notes = [
        "bubble, measured: 1 - compute time / (ranks x makespan) of logged iterations' "
        "per-action spans; the simulator assumes equal stages and free communication."
    ]
    cores = run.get("cpu_count") or 0
    if run["device"] == "cpu" and run["world_size"] > cores:
        notes.append(
            f"note: {run['world_size']} ranks time-share {cores} CPU cores, so a rank waiting "
            "for a peer lends its core to another rank and idle time partly disappears: speed "
            "ratios on this machine are not representative of one device per rank (for "
            f"that, give each rank a core: --ranks N with 2 <= N <= {cores})."
        )
    return notes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    compare = sub.add_parser("compare", help="compare two runs' logs (or summary JSON files)")
    compare.add_argument("run")
    compare.add_argument("baseline")
    parser.add_argument("--out", default="out/demo", help="data, logs and timelines go here")
    parser.add_argument("--ranks", type=int, default=4, help="ranks = pipeline size")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="one GPU per rank")
    parser.add_argument("--train-iters", type=int, default=30)
    return parser.parse_args(argv)


def _torchrun() -> list[str]:
    """The venv's ``torchrun`` (``python -m torch.distributed.run`` where there is none)."""
    beside = Path(sys.executable).with_name("torchrun")
    return [str(beside)] if beside.is_file() else [sys.executable, "-m", "torch.distributed.run"]


def demo(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix, vocab = prepare_data(out / "data")
    common = [
        *(
            "--pipeline-model-parallel-size",
            str(args.ranks),
            "--train-iters",
            str(args.train_iters),
            "--device",
            args.device,
            "--num-layers",  # at least R*P = 2 * ranks stages to fill
            str(max(8, 2 * args.ranks)),
        ),
        *("--data-path", prefix, "--vocab-file", vocab, *MODEL_ARGS),
    ]
    launcher = [*_torchrun(), "--standalone"]
    launcher += ["--nproc-per-node", str(args.ranks), str(HERE / "pretrain_bert.py")]
    summaries = {}
    for name, flags in RUNS:
        trace = ["--pipeline-reuse-trace", str(out / name)]
        summaries[name] = run_training(name, [*launcher, *common, *flags, *trace])
        (out / f"{name}.json").write_text(json.dumps(summaries[name], indent=1))
    print("\n" + compare_summaries(summaries["prt"], summaries["1f1b"]))
    print(f"demo wall time: {time.perf_counter() - started:.0f} s (summaries in {out}/*.json)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "compare":
        print(compare_summaries(read_summary(args.run), read_summary(args.baseline)))
    else:
        demo(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
