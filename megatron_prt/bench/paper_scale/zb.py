"""paper_scale's split-backward section: PRT with split backward (zero bubble) and torch's
own schedules, timed under the same costs as every other row.

Each backward splits into I (input gradient) and W (weight gradient, :data:`.jobs.WGRAD_FRACTION`
of it). The rows: ZB-H1 (the split-backward planner at R = 1, uni), PRT with split backward
at every R, placement and direction (all under plain 1F1B's activation memory, the
planner's default cap), and torch.distributed.pipelining's Interleaved1F1B,
InterleavedZeroBubble (ZB1P), ZBVZeroBubble and DualPipeV orders where torch accepts the
configuration. A split-backward order may run W right after I, so a split row also keeps
the non-split order of the same placement when that is faster (:func:`keep_non_split`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from ...core import Placement
from ..report import md_table
from .jobs import (
    H200_MAIN_LINK,
    IDEAL,
    MAIN_LINK,
    PLACEMENTS,
    RANKS,
    WGRAD_FRACTION,
    Job,
    Outcome,
    Results,
    Settings,
)
from .split import TORCH
from .tuned import TUNE_REUSE, TUNED, tuned_row

SPLIT_LINKS = (MAIN_LINK, H200_MAIN_LINK)
TORCH_REUSES = {"ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"}  # take any R


def zb_variants(reuses: Sequence[int]) -> list:
    from .jobs import Variant

    out = [Variant("ZB-H1", Placement(RANKS, 1), "zb", "zb")]
    out.append(Variant("ZB bi R=1", Placement(RANKS, 1, "loop", "bi"), "zb", "zb"))
    out += [
        Variant(f"ZB R={r} {pl}/{d}", Placement(RANKS, r, pl, d), "zb", "zb")
        for d in ("uni", "bi")
        for r in reuses
        for pl in PLACEMENTS
    ]
    return out


def torch_variants(reuses: Sequence[int]) -> list:
    from ...runtime.peers import PEERS, peer_placement  # torch is not needed here: labels only
    from .jobs import Variant

    out = []
    for peer in PEERS:
        for r in reuses if peer.name in TORCH_REUSES else (2,):
            placement = peer_placement(peer, RANKS, r)
            label = peer.label + (f" R={placement.reuse}" if placement.reuse > 1 else "")
            out.append(Variant(label, placement, TORCH + peer.name, "peer"))
    return out


def split_jobs(jobs: Sequence[Job], s: Settings) -> list[Job]:
    """Every split-backward and torch row for the even-split (model, m) of ``jobs`` on the
    main links (V100 ``MAIN_LINK``, H200 ``H200_MAIN_LINK``) at the main table's m (the
    split-backward planner is the slowest step of the benchmark: the other links' rows
    are left out for time)."""
    keys = {
        (j.model, j.link, j.microbatches, j.replica_sum)
        for j in jobs
        if j.partition == "even"
        and j.model != IDEAL
        and j.link in SPLIT_LINKS
        and j.microbatches in s.microbatches
    }
    variants = [*zb_variants(s.reuses), *torch_variants(s.reuses)]
    return [Job(n, k, m, v, paid) for n, k, m, paid in sorted(keys) for v in variants]


def balanced_split_jobs(results: Results, s: Settings) -> list[Job]:
    """Split-backward uni rows on the balanced splits the partitioner found for the
    non-split uni rows of the same placement (ZB-H1: 1F1B's)."""
    out = []
    for job, o in results.items():
        v = job.variant
        if job.partition != "balanced" or v.direction != "uni" or v.role not in ("prt", "baseline"):
            continue
        label = "ZB-H1" if v.placement.reuse == 1 else f"ZB {v.label}"
        zb = replace(v, label=label, schedule="zb", role="zb")
        out.append(replace(job, variant=zb, stage_layers=o.stage_layers))
    return out


def keep_non_split(results: Results) -> Results:
    """A split-backward row keeps the non-split order of its placement (same model, link,
    m, split) when that is faster: running W right after I is one split-backward order."""
    out = Results(results)
    for job, o in results.items():
        if job.variant.role != "zb":
            continue
        same = [
            other
            for j, other in results.items()
            if j.variant.role in ("prt", "baseline", "reference")
            and j.variant.placement == job.variant.placement
            and (j.model, j.link, j.microbatches, j.replica_sum, j.partition)
            == (job.model, job.link, job.microbatches, job.replica_sum, job.partition)
        ]
        best = min(same, key=lambda x: x.ms, default=None)
        if best is not None and best.ms < o.ms:
            out[job] = replace(best, job=job, plan=f"non-split {best.job.variant.label}")
    return out


def pick(results: Results, key: tuple, role: str, direction: str | None = None) -> list[Outcome]:
    return [
        o
        for j, o in results.items()
        if (j.model, j.link, j.microbatches, j.replica_sum, j.partition) == key
        and j.variant.role == role
        and (direction is None or j.variant.direction == direction)
    ]


def fastest(outcomes: Sequence[Outcome]) -> Outcome:
    return min(outcomes, key=lambda o: o.ms)


def split_summary(results: Results, key: tuple) -> dict[str, Outcome]:
    """For one (model, link, m, replica_sum, split): 1F1B, ZB-H1, the best PRT split-backward
    uni and bi, the best non-split PRT and the best torch row."""
    zb = pick(results, key, "zb")
    torch_rows = [o for o in pick(results, key, "peer") if math.isfinite(o.ms)]
    out = {
        "1F1B": next(o for o in pick(results, key, "baseline", "uni")),
        "ZB-H1": next(o for o in zb if o.job.variant.label == "ZB-H1"),
        "zb uni": fastest([o for o in zb if o.job.variant.direction == "uni"]),
        "prt": fastest(pick(results, key, "prt")),
    }
    bi = [o for o in zb if o.job.variant.direction == "bi"]
    if bi:
        out["zb bi"] = fastest(bi)
    if torch_rows:
        out["torch"] = fastest(torch_rows)
    return out


def best_zb(summary: dict[str, Outcome]) -> Outcome:
    return fastest([summary[k] for k in ("zb uni", "zb bi") if k in summary])


def _row(o: Outcome, one_f_one_b: float) -> tuple:
    v = o.job.variant
    label = v.label if v.role in ("baseline", "zb", "peer") else f"non-split PRT {v.label}"
    if v.role == TUNED:
        label = f"**tuned**: {v.label}"
    if v.role == "zb" and v.label != "ZB-H1":
        label = f"PRT {label}"
    if not math.isfinite(o.ms):
        return (o.job.model, o.job.microbatches, label, "n/a", "", "", "", o.plan)
    return (
        o.job.model,
        o.job.microbatches,
        label,
        f"{o.ms:.1f}",
        f"{one_f_one_b / o.ms:.3f}x",
        f"{o.busiest:.3f}",
        f"{o.peak_gib:.1f}",
        o.plan,
    )


def split_table(results: Results, names, link: str, ms_, paid: bool = False) -> list[str]:
    """Per model and m: 1F1B, the best non-split PRT, ZB-H1, the best PRT split-backward uni
    and bi, and every torch row."""
    header = (
        "model",
        "m",
        "schedule",
        "iteration ms",
        "vs 1F1B",
        "busiest rank compute ÷ iteration",
        "peak GiB/rank",
        "plan kept",
    )
    rows = []
    for name in names:
        for m in ms_:
            key = (name, link, m, paid, "even")
            summary = split_summary(results, key)
            first = summary["1F1B"].ms
            shown = []
            for k in ("1F1B", "prt", "ZB-H1", "zb uni", "zb bi"):
                if k in summary and summary[k] not in shown:  # ZB-H1 may be the fastest uni
                    shown.append(summary[k])
            shown += pick(results, key, "peer")
            tuned = tuned_row(results, key[:4])
            shown += [tuned] if tuned else []
            rows += [_row(o, first) for o in shown]
    return md_table(header, "lllrrrrl", rows)


def split_links_table(results: Results, keys: Sequence[tuple]) -> list[str]:
    """One row per (model, link, m, replica_sum): the best of each kind and the gains."""
    header = (
        "model",
        "link",
        "m",
        "1F1B ms",
        "best PRT ms",
        "ZB-H1 ms",
        "best PRT split-backward ms",
        "best torch ms",
        "PRT split vs 1F1B",
        "PRT split vs best torch",
        "tuned ms",
        "tuned vs fastest other row",
    )
    rows = []
    for key in keys:
        sm = split_summary(results, key)
        best = best_zb(sm)
        torch_best = sm.get("torch")
        tuned = tuned_row(results, key[:4])
        rows.append(
            (
                key[0],
                key[1],
                key[2],
                f"{sm['1F1B'].ms:.1f}",
                f"{sm['prt'].ms:.1f} ({_short(sm['prt'])})",
                f"{sm['ZB-H1'].ms:.1f}",
                f"{best.ms:.1f} ({_short(best)})",
                f"{torch_best.ms:.1f} ({torch_best.job.variant.label})" if torch_best else "n/a",
                f"{sm['1F1B'].ms / best.ms - 1:+.1%}",
                f"{torch_best.ms / best.ms - 1:+.1%}" if torch_best else "n/a",
                *_tuned_cells(results, key, tuned),
            )
        )
    return md_table(header, "lll" + "r" * 9, rows)


def _tuned_cells(results: Results, key: tuple, tuned: Outcome | None) -> tuple[str, str]:
    """The tuned row's time and its gain over the fastest other row of the same model,
    link and m (every split, every kind)."""
    if tuned is None:
        return ("n/a", "n/a")
    others = [
        o
        for j, o in results.items()
        if (j.model, j.link, j.microbatches, j.replica_sum) == key[:4]
        and j.variant.role != TUNED
        and math.isfinite(o.ms)
    ]
    best = fastest(others)
    return (
        f"{tuned.ms:.1f} ({tuned.job.variant.label})",
        f"{best.ms / tuned.ms - 1:+.1%} (vs {best.job.variant.label}, {best.job.partition})",
    )


def _short(o: Outcome) -> str:
    p = o.job.variant.placement
    return f"R={p.reuse} {p.placement}/{p.direction}"


def split_keys(results: Results) -> list[tuple]:
    return sorted(
        {
            (j.model, j.link, j.microbatches, j.replica_sum, j.partition)
            for j in results
            if j.variant.label == "ZB-H1" and j.partition == "even"
        }
    )


def balanced_split_rows(results: Results, s: Settings) -> list[tuple]:
    """(model, m, 1F1B balanced, best PRT split-backward uni balanced, best torch, gains)."""
    rows = []
    for name in s.h200_names:
        for m in s.microbatches:
            key = (name, H200_MAIN_LINK, m, True, "balanced")
            zb = pick(results, key, "zb")
            if not zb:
                continue
            base = next(o for o in pick(results, key, "baseline", "uni"))
            best = fastest(zb)
            torch_best = split_summary(results, (*key[:4], "even")).get("torch")
            rows.append((name, m, base, best, torch_best))
    return rows


def balanced_split_table(results: Results, s: Settings) -> list[str]:
    header = (
        "model",
        "m",
        "1F1B balanced ms",
        "best PRT split-backward uni, balanced ms",
        "best torch ms (even)",
        "vs 1F1B balanced",
        "vs best torch",
        "busiest rank compute ÷ iteration",
    )
    cells = [
        (
            name,
            m,
            f"{base.ms:.1f}",
            f"{best.ms:.1f} ({best.job.variant.label}; {best.plan})",
            f"{t.ms:.1f} ({t.job.variant.label})" if t else "n/a",
            f"**{base.ms / best.ms - 1:+.1%}**",
            f"{t.ms / best.ms - 1:+.1%}" if t else "n/a",
            f"{base.busiest:.3f} → {best.busiest:.3f}",
        )
        for name, m, base, best, t in balanced_split_rows(results, s)
    ]
    return md_table(header, "ll" + "r" * 6, cells)


def split_section(results: Results, s: Settings) -> list[str]:
    if not any(j.variant.role == "zb" for j in results):
        return []
    h200 = [n for n in s.h200_names]
    lines = [
        "## Split backward (zero bubble) and torch's schedules",
        "",
        "Each backward splits into I (input gradient, which the stage upstream waits for) "
        f"and W (weight gradient, {WGRAD_FRACTION:.0%} of the backward; nothing waits for it "
        "but the optimizer step). The FLOP model prices a backward as two GEMMs of the "
        "forward's FLOPs, one for each, so W is half of it there (attention's score "
        "products have no weights, which this ignores); the H200 profiles time backward "
        "whole, and W is taken as the same half. After I a stage keeps 32/34 of its "
        "activation bytes until W (the inputs of a transformer layer's weight GEMMs and "
        "their output gradients; the ResNet rows take the same share). *ZB-H1* is the "
        'split-backward planner (`build_plan(placement, m, "zb", times)`) at R = 1; *PRT '
        "ZB* rows are the same planner at every R, placement and direction, the fastest "
        "shown; all run under plain 1F1B's activation memory (the planner's default cap). "
        "A split-backward order may run W right after I, so a split row keeps the "
        "non-split order of its placement when that is faster (*plan kept*). The torch "
        "rows are torch.distributed.pipelining's own orders read into our plan IR "
        "(`megatron_prt.runtime.peers`) and simulated under the same costs; torch refuses "
        "some configurations (n/a, with its reason). *Busiest rank compute ÷ iteration*: "
        "1.0 = no bubble on the busiest rank (the zero-bubble limit). *non-split PRT*: the "
        "fastest PRT row of the tables above, for comparison. *tuned*: what `megatron-prt "
        f"tune` picks under the same costs (R up to {TUNE_REUSE}, every schedule family, "
        "split backward on and off, the even and the partitioner's split, plans for the "
        "real costs, within the GPU's memory; `megatron_prt.bench.paper_scale.tuned`); "
        "every row faster than its own search would be shown to it as a seed, and *plan "
        "kept* names any such row, so the tuned row is never slower than another.",
        "",
        f"### Per model and m (`{MAIN_LINK}`)",
        "",
        *split_table(results, s.names, MAIN_LINK, s.microbatches),
        "",
    ]
    if h200:
        lines += [
            f"### H200 profiles (`{H200_MAIN_LINK}`, replica sum on)",
            "",
            *split_table(results, h200, H200_MAIN_LINK, s.microbatches, True),
            "",
        ]
        if balanced_split_rows(results, s):
            lines += [
                f"### H200, balanced splits (`{H200_MAIN_LINK}`)",
                "",
                "The split-backward uni rows on the split the partitioner found for the "
                "non-split row of the same placement (ZB-H1: 1F1B's), against 1F1B on its "
                "balanced split; torch's rows on the even split.",
                "",
                *balanced_split_table(results, s),
                "",
            ]
    lines += [
        "### Every model and m",
        "",
        *split_links_table(results, split_keys(results)),
        "",
    ]
    return lines
