"""PRT at the paper's scale, simulated: BERT and ResNet on 8 GPUs from FLOP and byte counts.

    python benchmarks/paper_scale.py                  # writes out/bench/paper_scale.md
    python benchmarks/paper_scale.py --quick          # m=8 only, no extras, tuned rows; prints it
    python benchmarks/paper_scale.py --out docs/benchmarks  # the committed one

No GPU is used. The costs come from the analytic cost source
(:mod:`megatron_prt.sim.analytic`: FLOP and byte counts of each unit, V100 peak figures times
an achieved fraction, p2p hops over a link) and from BERT profiles measured on an H200
(:mod:`.profiles`). The simulator (:mod:`megatron_prt.sim.simulate`) then times the plans from
:func:`megatron_prt.core.build_plan` for 1F1B, PRT uni (R in {2, 4}, loop/wave), Chimera-style
bi (R = 1) and PRT bi (R in {2, 4}, loop/wave), and the report sets the gains beside the
paper's (Ji et al., IEEE CLUSTER 2025, abstract only). Every PRT-generator row is timed on
two plans, the one built for the real costs and the runtime's default one built for uniform
stages, and the faster is kept (:func:`.jobs.candidate_plans`). Every figure and assumption
used is stated in the report (:func:`.prose.assumptions`), and every number its summary
quotes is computed from the simulations (:func:`.prose.summary`). The section on BERT costs
profiled on an H200 also times 1F1B and PRT uni on the partitioner's fastest layer split
(:func:`.jobs.balanced_cost`). The last section (:mod:`.zb`, ``--no-split`` leaves it out)
times split-backward plans (ZB-H1, PRT with split backward) and torch's own schedules under
the same costs, on the main links at the main table's m; it reads the other rows, which it
does not change. Its tables end with the tuned row (:mod:`.tuned`, ``--no-tune`` leaves it
out): ``megatron-prt tune``'s pick under the same costs, never slower than another row.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence

from ...sim.analytic import LINKS
from .h200 import h200_section
from .jobs import (
    DEFAULT_OUT,
    MAIN_LINK,
    MICROBATCHES,
    REUSES,
    Results,
    Settings,
    all_jobs,
    keep_faster_split,
    run_all,
    settings_of,
)
from .prose import assumptions, summary
from .tables import (
    candidates_table,
    curve_table,
    main_table,
    model_rows,
    paper_table,
    sensitivity_table,
)
from .tuned import run_tuned_all
from .zb import balanced_split_jobs, keep_non_split, split_jobs, split_section


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the simulation workers), s."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def report(
    argv: Sequence[str], s: Settings, results: Results, wall_s: float, split: Results
) -> str:
    """The markdown report; ``split`` holds ``results`` and the split-backward and torch rows
    (:mod:`.zb`), which only their own section reads."""
    link = LINKS[MAIN_LINK]
    lines = [
        "# PRT at the paper's scale (simulated): BERT and ResNet on 8 GPUs",
        "",
        f"Command: `{' '.join(['python benchmarks/paper_scale.py', *argv])}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; wall time {wall_s:.0f} s (CPU {cpu_seconds():.0f} s) "
        f"for {len(split)} simulated iterations. No GPU was used: every number below is "
        "a simulator prediction from the cost model described under Assumptions.",
        "",
        *summary(results, s),
        "## Against the paper",
        "",
        "Throughput gains (uni: PRT over 1F1B; bi: PRT over Chimera). First the setting of "
        "docs/theory.md (D equal stages, free communication), then our models on "
        f"`{MAIN_LINK}`. The last column is the m at which our gain equals the paper's "
        f"(interpolated in log m over m in {{{', '.join(map(str, s.curve))}}}).",
        "",
        *paper_table(results, s.names, s.microbatches, s.curve),
        "",
        "## The models",
        "",
        *model_rows(s.names),
        "",
        f"## Iteration time, bubble and memory (P = 8, link: {link.label})",
        "",
        "Per model and m: the baseline, then the fastest PRT configuration.",
        "",
        *main_table(results, s.names, MAIN_LINK, s.microbatches),
        "",
        *curve_section(results, s),
        *sensitivity_section(results, s),
        f"## Every candidate (iteration ms, `{MAIN_LINK}`)",
        "",
        *candidates_table(results, s.names, MAIN_LINK, s.microbatches, s.reuses),
        "",
        *h200_section(results, s),
        *split_section(split, s),
        *assumptions(s),
        "",
    ]
    return "\n".join(lines) + "\n"


def curve_section(results: Results, s: Settings) -> list[str]:
    """The report's gain-by-m section; none when ``s.curve`` has one m."""
    if len(s.curve) <= 1:
        return []
    return [
        "## Gain by number of micro-batches",
        "",
        *curve_table(results, s.names, s.curve),
        "",
    ]


def sensitivity_section(results: Results, s: Settings) -> list[str]:
    """The report's gain-by-link section; none without ``s.sensitivity_links``."""
    if not s.sensitivity_links:
        return []
    return [
        f"## How the gain depends on the link (m = {s.sensitivity_m})",
        "",
        "Gain of the best PRT configuration (in brackets) over its baseline, per link.",
        "",
        *sensitivity_table(results, s.names, s.sensitivity_links, s.sensitivity_m),
        "",
    ]


# -- command line --------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]):
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument(
        "--quick",
        action="store_true",
        help="m = 8 only, no extras, no file; the tuned rows still run (about 10 min on one "
        "core; --no-tune leaves them out: about 2 min)",
    )
    p.add_argument("--out", help=f"markdown report (default {DEFAULT_OUT}; --quick: stdout)")
    p.add_argument(
        "--microbatches",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        default=MICROBATCHES,
        help="m values of the main table, comma-separated (default 8,16,32)",
    )
    p.add_argument(
        "--reuses",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        default=REUSES,
        help="R values PRT may use, comma-separated (default 2,4)",
    )
    p.add_argument(
        "--no-split",
        action="store_true",
        help="leave out the split-backward and torch rows (their section)",
    )
    p.add_argument(
        "--no-tune",
        action="store_true",
        help="leave out the tuned rows (megatron-prt tune's pick) of the split section",
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = time.perf_counter()
    s = settings_of(args)
    jobs = all_jobs(s)
    results = keep_faster_split(Results(run_all(jobs, args.jobs)))
    split = Results(results)
    if not args.no_split:
        extra = split_jobs(jobs, s) + balanced_split_jobs(results, s)
        split = keep_non_split(Results({**results, **run_all(extra, args.jobs)}))
        if not args.no_tune:
            tuning = time.perf_counter()
            split = run_tuned_all(split, args.jobs)
            print(f"tuned rows: {time.perf_counter() - tuning:.0f} s", file=sys.stderr)
    text = report(argv, s, results, time.perf_counter() - started, split)
    out = args.out or (None if args.quick else DEFAULT_OUT)
    if out and os.path.isdir(out):  # --out docs/benchmarks: the report's usual name there
        out = os.path.join(out, os.path.basename(DEFAULT_OUT))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")
    else:
        print(text)
    return 0
