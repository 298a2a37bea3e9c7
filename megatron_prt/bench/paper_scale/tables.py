"""paper_scale's tables: every number they hold comes from :class:`.jobs.Results`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from ...core import Placement
from ...sim.analytic import GIB, H200_MEMORY, LINKS, V100_MEMORY, Link, flops_ms, layer_cost, models
from ...sim.cost import CostModel, LayerCost
from ..report import md_table
from .jobs import (
    H200_MAIN_LINK,
    IDEAL,
    IDEAL_LINK,
    MAIN_LINK,
    PAPER_GAINS,
    RANKS,
    REFERENCE,
    Job,
    Outcome,
    Results,
    Settings,
    all_variants,
    balanced_variants,
    matching_m,
    rank_loads,
)
from .profiles import PROFILES, profiled, profiled_cost


# -- report --------------------------------------------------------------------------------------
def fmt_gib(x: float, limit: float = V100_MEMORY) -> str:
    flag = " (!)" if x * GIB > limit else ""
    return f"{x:.1f}{flag}"


def pct(x: float) -> str:
    return f"{x:+.1%}"


def model_rows(names: Sequence[str]) -> list[str]:
    header = (
        "model",
        "micro-batch",
        "layers (units)",
        "params",
        "fwd GFLOP / micro-batch",
        "fwd ms / micro-batch",
        "act GiB / micro-batch",
        "stage messages MiB (min..max)",
    )
    rows = []
    for name in names:
        m = models()[name]
        outs = [u.out_bytes for u in (m.embedding, *m.layers[:-1])]
        flops = sum(u.fwd_flops for u in m.units)
        rows.append(
            (
                name,
                m.micro_batch,
                f"{len(m.layers)} (+{m.embedding.name}, +{m.head.name})",
                f"{m.params / 1e6:.1f} M",
                f"{flops / 1e9:.0f}",
                f"{flops_ms(m, flops):.1f}",
                f"{sum(u.act_bytes for u in m.units) / GIB:.2f}",
                f"{min(outs) / 2**20:.1f}..{max(outs) / 2**20:.1f}",
            )
        )
    return md_table(header, "l" * len(header), rows)


def main_table(results: Results, names, link: str, ms_, replica_sum=False) -> list[str]:
    header = (
        "model",
        "m",
        "schedule",
        "iteration ms",
        "bubble",
        "gain",
        "reuse alone",
        "vs 1F1B",
        "hop ms",
        "peak GiB/rank",
        "max/min",
    )
    rows = []
    for name in names:
        for m in ms_:
            one_f_one_b = results.compare(name, link, m, "uni", replica_sum).baseline.ms
            for direction in ("uni", "bi"):
                c = results.compare(name, link, m, direction, replica_sum)
                rows.append(_outcome_row(c.baseline, "", "", one_f_one_b))
                rows.append(
                    _outcome_row(c.best, f"**{pct(c.gain)}**", pct(c.reuse_gain), one_f_one_b)
                )
    return md_table(header, "l" * len(header), rows)


def _outcome_row(o: Outcome, gain: str, reuse: str, one_f_one_b: float) -> tuple:
    v = o.job.variant
    label = v.label if v.role == "baseline" else f"PRT {v.label}"
    if o.empty:
        label += f" ({o.empty} empty stages)"
    memory = H200_MEMORY if o.job.model in PROFILES else V100_MEMORY
    return (
        o.job.model,
        o.job.microbatches,
        label,
        f"{o.ms:.1f}",
        f"{o.bubble:.1%}",
        gain,
        reuse,
        f"{one_f_one_b / o.ms:.3f}x",
        f"{o.hop_ms:.3f}",
        fmt_gib(o.peak_gib, memory),
        f"{o.balance:.2f}",
    )


def candidates_table(results: Results, names, link: str, ms_, reuses, replica_sum=False):
    variants = all_variants(reuses)
    header = ("model", "m", *(v.label for v in variants))
    rows = [
        (name, m, *(_ms_cell(results.at(name, link, m, v, replica_sum)) for v in variants))
        for name in names
        for m in ms_
    ]
    return md_table(header, "l" * len(header), rows)


def _ms_cell(o: Outcome) -> str:
    return f"{o.ms:.1f}" + ("†" if o.plan == "runtime default" else "")


def paper_rows(names: Sequence[str]) -> list[tuple[str, str]]:
    """(model, link) rows of the paper comparison: the closed-form setting first."""
    return [(IDEAL, IDEAL_LINK)] + [(n, MAIN_LINK) for n in names]


def family_of(name: str) -> tuple[str, ...]:
    return ("BERT", "ResNet") if name == IDEAL else (models()[name].family,)


def paper_table(results: Results, names, ms_, curve) -> list[str]:
    header = ("model", "direction", "paper", *(f"ours m={m}" for m in ms_), "ours = paper at")
    rows = []
    for name, link in paper_rows(names):
        for family in family_of(name):
            for direction in ("uni", "bi"):
                target = PAPER_GAINS[(family, direction)]
                gains = results.gains(name, link, curve, direction)
                where = matching_m(gains, target) if len(curve) > 1 else "n/a (--quick)"
                label = f"{name} (vs {family})" if name == IDEAL else name
                cells = (pct(gains[m]) for m in ms_)
                rows.append((label, direction, f"{target:+.2%}", *cells, where))
    return md_table(header, "l" * len(header), rows)


def curve_table(results: Results, names, curve) -> list[str]:
    header = ("model", "link", "direction", *(f"m={m}" for m in curve))
    rows = []
    for name, link in paper_rows(names):
        for direction in ("uni", "bi"):
            gains = results.gains(name, link, curve, direction)
            rows.append((name, link, direction, *(pct(gains[m]) for m in curve)))
    return md_table(header, "l" * len(header), rows)


def sensitivity_table(results: Results, names, links, m: int) -> list[str]:
    header = ("model", *(f"{k} {d}" for k in links for d in ("uni", "bi")))
    rows = []
    for name in names:
        cells = []
        for link in links:
            for direction in ("uni", "bi"):
                c = results.compare(name, link, m, direction)
                p = c.best.job.variant.placement
                cells.append(f"{pct(c.gain)} (R={p.reuse} {p.placement})")
        rows.append((name, *cells))
    return md_table(header, "l" * len(header), rows)


def empty_stage_note(names: Sequence[str], reuses: Sequence[int]) -> str:
    """Which (model, R) leave stages without a layer, computed."""
    notes = [
        f"{name} R={r}: {r * RANKS - len(models()[name].layers)} of {r * RANKS}"
        for name in names
        for r in reuses
        if r * RANKS > len(models()[name].layers)
    ]
    return "; ".join(notes) if notes else "none"


def reaches_paper(results: Results, s: Settings, name: str, direction: str) -> bool:
    target = PAPER_GAINS[(models()[name].family, direction)]
    return max(results.gains(name, MAIN_LINK, s.curve, direction).values()) >= target


def short_label(o: Outcome) -> str:
    p = o.job.variant.placement
    return f"R={p.reuse} {p.placement}"


def gain_at(results: Results, name: str, link: str, m: int, direction: str) -> str:
    if Job(name, link, m, REFERENCE) not in results:
        return "n/a"
    return pct(results.compare(name, link, m, direction).gain)


def work(part: LayerCost) -> float:
    return part.fwd + part.bwd


def mean_layer(cost: CostModel) -> LayerCost:
    n = len(cost.layers)
    return LayerCost(
        sum(u.fwd for u in cost.layers) / n,
        sum(u.bwd for u in cost.layers) / n,
        param=sum(u.param for u in cost.layers) / n,
    )


def v100_layer(name: str) -> tuple[LayerCost, LayerCost]:
    """(a layer, the head) of the FLOP model of the same shape, in ms."""
    model = models()[PROFILES[name].v100]
    return layer_cost(model, model.layers[0]), layer_cost(model, model.head)


def hop_ms(message_bytes: float, link: Link) -> float:
    return 1e3 * (link.latency + message_bytes / link.bandwidth)


def rank_imbalance(cost: CostModel, placement: Placement) -> float:
    """Compute (forward + backward) of the busiest rank over the mean rank's."""
    loads = rank_loads(cost, placement)
    return max(loads) / (sum(loads) / len(loads))


def replica_mib(name: str, reuse: int) -> float:
    """Gradient MiB the busiest rank sends its mirrored rank under bi (R = ``reuse``)."""
    placement = Placement(RANKS, reuse, "loop", "bi")
    cost = profiled_cost(name, placement, LINKS[H200_MAIN_LINK], True)
    grads = cost.stage_grad_bytes(placement)
    sent = [sum(grads[placement.model_stage(k)] for k in ks) for ks in placement.rank_stages]
    return max(sent) / 2**20


def profile_rows(names: Sequence[str]) -> list[str]:
    k4, k5 = LINKS["nvlink4"], LINKS["pcie5"]
    header = (
        "model",
        "layers",
        "layer fwd / bwd ms",
        "embedding fwd / bwd ms",
        "head fwd / bwd ms",
        "head ÷ layer",
        "message MiB",
        "hop µs nvlink4 / pcie5",
        "hop ÷ layer fwd nvlink4 / pcie5",
        "V100 rows: head ÷ layer, hop ÷ layer fwd (nvlink)",
    )
    rows = []
    for name in names:
        cost, layer = profiled(name), mean_layer(profiled(name))
        v_layer, v_head = v100_layer(name)
        v_model = models()[PROFILES[name].v100]
        v_hop = hop_ms(v_model.layers[0].out_bytes, LINKS[MAIN_LINK])
        h4, h5 = (hop_ms(cost.message_bytes, k) for k in (k4, k5))
        rows.append(
            (
                name,
                len(cost.layers),
                f"{layer.fwd:.2f} / {layer.bwd:.2f}",
                f"{cost.embedding.fwd:.2f} / {cost.embedding.bwd:.2f}",
                f"{cost.head.fwd:.2f} / {cost.head.bwd:.2f}",
                f"{work(cost.head) / work(layer):.2f}",
                f"{cost.message_bytes / 2**20:.0f}",
                f"{1e3 * h4:.0f} / {1e3 * h5:.0f}",
                f"{h4 / layer.fwd:.1%} / {h5 / layer.fwd:.1%}",
                f"{work(v_head) / work(v_layer):.3f}, {v_hop / v_layer.fwd:.1%}",
            )
        )
    return md_table(header, "l" * len(header), rows)


def side_by_side(results: Results, s: Settings) -> list[str]:
    ms_ = s.microbatches
    header = (
        "model",
        "direction",
        "paper",
        *(f"V100 FLOP model m={m}" for m in ms_),
        *(f"H200 profile m={m}" for m in ms_),
    )
    rows = []
    for name in s.h200_names:
        v100 = PROFILES[name].v100
        for direction in ("uni", "bi"):
            flop = results.gains(v100, MAIN_LINK, ms_, direction)
            prof = results.gains(name, H200_MAIN_LINK, ms_, direction, True)
            cells = [pct(flop[m]) for m in ms_] + [pct(prof[m]) for m in ms_]
            target = PAPER_GAINS[("BERT", direction)]
            rows.append((v100, direction, f"{target:+.2%}", *cells))
    return md_table(header, "l" * len(header), rows)


def h200_link_table(results: Results, s: Settings) -> list[str]:
    links = s.h200_links
    header = ("model", "m", *(f"{k} {d}" for k in links for d in ("uni", "bi")))
    rows = []
    for name in s.h200_names:
        for m in s.microbatches:
            cells = []
            for k in links:
                for direction in ("uni", "bi"):
                    c = results.compare(name, k, m, direction, True)
                    cells.append(f"{pct(c.gain)} ({short_label(c.best)})")
            rows.append((name, m, *cells))
    return md_table(header, "l" * len(header), rows)


def replica_table(results: Results, s: Settings) -> list[str]:
    header = (
        "model",
        "link",
        "m",
        "Chimera-style bi ms: without → with (sum)",
        "best PRT bi ms: without → with (sum)",
        "gain without",
        "gain with",
    )
    rows = []
    for name in s.h200_names:
        for k in s.h200_links:
            if math.isinf(LINKS[k].bandwidth):
                continue
            for m in s.microbatches:
                off, on = (results.compare(name, k, m, "bi", paid) for paid in (False, True))
                rows.append(
                    (
                        name,
                        k,
                        m,
                        f"{off.baseline.ms:.1f} → {on.baseline.ms:.1f} "
                        f"({on.baseline.replica_ms:.2f})",
                        f"{off.best.ms:.1f} → {on.best.ms:.1f} "
                        f"({on.best.replica_ms:.2f}, {short_label(on.best)})",
                        pct(off.gain),
                        pct(on.gain),
                    )
                )
    return md_table(header, "l" * len(header), rows)


def balanced_gain_table(results: Results, s: Settings) -> list[str]:
    header = (
        "model",
        "m",
        "1F1B ms: even → balanced",
        "best PRT uni ms: even → balanced",
        "PRT even vs 1F1B even",
        "PRT balanced vs 1F1B even",
        "PRT balanced vs 1F1B balanced",
    )
    rows = []
    for name in s.h200_names:
        for m in s.microbatches:
            even, bal = (
                results.compare(name, H200_MAIN_LINK, m, "uni", True, split)
                for split in ("even", "balanced")
            )
            vs_even = even.baseline.ms / bal.best.ms - 1
            rows.append(
                (
                    name,
                    m,
                    f"{even.baseline.ms:.1f} → {bal.baseline.ms:.1f}",
                    f"{even.best.ms:.1f} ({short_label(even.best)}) → {bal.best.ms:.1f} "
                    f"({short_label(bal.best)})",
                    pct(even.gain),
                    pct(vs_even),
                    f"**{pct(bal.gain)}**",
                )
            )
    return md_table(header, "l" * len(header), rows)


def balanced_rows(results: Results, s: Settings) -> list[str]:
    header = (
        "model",
        "m",
        "schedule",
        "ms: even → balanced",
        "peak GiB/rank: even → balanced",
        "busiest ÷ mean rank: even → balanced",
        "balanced layers per stage",
        "search",
    )
    rows = []
    for name in s.h200_names:
        for m in s.microbatches:
            for v in balanced_variants(s.reuses):
                even, bal = (
                    results.at(name, H200_MAIN_LINK, m, v, True, split)
                    for split in ("even", "balanced")
                )
                spread = [split_imbalance(o) for o in (even, bal)]
                label = v.label if v.role == "baseline" else f"PRT {v.label}"
                rows.append(
                    (
                        name,
                        m,
                        label,
                        f"{even.ms:.1f} → {bal.ms:.1f} ({bal.ms / even.ms - 1:+.1%})",
                        f"{even.peak_gib:.1f} → {fmt_gib(bal.peak_gib, H200_MEMORY)}",
                        f"{spread[0]:.2f} → {spread[1]:.2f}",
                        ",".join(map(str, bal.stage_layers)),
                        bal.search,
                    )
                )
    return md_table(header, "l" * len(header), rows)


def split_imbalance(o: Outcome) -> float:
    """Busiest rank's compute over the mean rank's, for the outcome's stage layers."""
    placement = o.job.variant.placement
    cost = replace(profiled(o.job.model), stage_layers=o.stage_layers)
    return rank_imbalance(cost, placement)


def h200_gain(results: Results, name: str, link: str, m: int, direction: str, paid=True):
    if Job(name, link, m, REFERENCE, True) not in results:
        return "n/a"
    return pct(results.compare(name, link, m, direction, paid).gain)


def h200_gains(results: Results, s: Settings, link: str, m: int, direction: str) -> str:
    """'BERT-base +x%, BERT-large +y%' for the profiled models."""
    return ", ".join(
        f"{PROFILES[n].v100} {h200_gain(results, n, link, m, direction)}" for n in s.h200_names
    )


def v100_gains(results: Results, s: Settings, link: str, m: int, direction: str) -> str:
    return ", ".join(
        f"{PROFILES[n].v100} {gain_at(results, PROFILES[n].v100, link, m, direction)}"
        for n in s.h200_names
    )


def link_chain(results: Results, s: Settings, name: str, m: int, direction: str) -> str:
    gains = " → ".join(h200_gain(results, name, k, m, direction) for k in s.h200_links)
    return f"{PROFILES[name].v100} {direction} {gains}"


def balanced_gains(results: Results, name: str, m: int) -> tuple[float, float, float]:
    """(1F1B balanced over 1F1B even, best PRT uni balanced over 1F1B even, over 1F1B
    balanced) as gains, on the main H200 link."""
    even, bal = (
        results.compare(name, H200_MAIN_LINK, m, "uni", True, split)
        for split in ("even", "balanced")
    )
    ms_1f1b = even.baseline.ms
    return ms_1f1b / bal.baseline.ms - 1, ms_1f1b / bal.best.ms - 1, bal.gain
