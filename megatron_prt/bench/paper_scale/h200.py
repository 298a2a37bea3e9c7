"""paper_scale's H200 section: the profiled BERTs beside the FLOP model, balanced
splits and the replica-gradient sum."""

from __future__ import annotations

import math

from ...core import Placement
from ...sim.analytic import (
    BERT_BASE,
    H200_HBM_BANDWIDTH,
    H200_LINKS,
    H200_MEMORY,
    LINKS,
    cost_model,
    models,
)
from ...tune.partition import (
    DEFAULT_SLACK,
    EXHAUSTIVE_LIMIT,
)
from .jobs import (
    H200_MAIN_LINK,
    MAIN_LINK,
    PAPER_GAINS,
    RANKS,
    Results,
    Settings,
)
from .profiles import (
    BF16_GRAD_BYTES,
    BF16_STATE_BYTES,
    PROFILES,
    profiled,
    profiled_cost,
    state_bytes_per_param,
)
from .tables import (
    balanced_gain_table,
    balanced_gains,
    balanced_rows,
    candidates_table,
    h200_gain,
    h200_gains,
    h200_link_table,
    hop_ms,
    link_chain,
    main_table,
    mean_layer,
    pct,
    profile_rows,
    rank_imbalance,
    replica_mib,
    replica_table,
    side_by_side,
    v100_gains,
    v100_layer,
    work,
)


def h200_section(results: Results, s: Settings) -> list[str]:
    """The H200 section: the profiles, what differs from the V100 rows, and its tables."""
    if not s.h200_names:
        return []
    return [*_h200_intro(s), "", *_h200_rest(results, s)]


def _h200_intro(s: Settings) -> list[str]:
    files = "; ".join(f"`{PROFILES[n].path}`" for n in s.h200_names)
    commands = "; ".join(f"`{PROFILES[n].command}`" for n in s.h200_names)
    per_param = ", ".join(f"{n} {state_bytes_per_param(n):.2f}" for n in s.h200_names)
    return [
        "## BERT with per-layer costs profiled on an H200",
        "",
        "The rows above price every unit from FLOP and byte counts on a V100. Here BERT-base "
        "and BERT-large are priced from costs measured by `megatron-prt profile` on one "
        "NVIDIA H200 (torch 2.11+cu130, megatron-core 0.16.1, the local "
        "non-Transformer-Engine spec, which materialises the attention scores, bf16, seq "
        f"{BERT_BASE.seq}, {BERT_BASE.batch} sequences per micro-batch, vocabulary "
        f"{BERT_BASE.vocab}): per layer, embedding and head, the measured forward and "
        "backward times, the activation bytes kept for backward and the parameter bytes. "
        f"Files: {files}, written by {commands}.",
        "",
        "What differs from the V100 rows, besides the times being measured:",
        "",
        "- **The head** is BERT's pretraining head as megatron-core builds it (LM transform, "
        "the decoder over all tokens to the vocabulary, the binary head, both losses), "
        "not the sequence classifier of the V100 rows; its parameters include the last "
        "stage's copy of the tied word embedding. The embedding's time includes megatron's "
        "forward_step overhead before the first layer.",
        f"- **Parameter bytes**: the profile's `param` is {BF16_STATE_BYTES} bytes per "
        "parameter (bf16 weight 2, fp32 main gradient 4, fp32 main weight 4, two fp32 Adam "
        f"moments 8; checked: a layer's `param` over its 12h² + 13h parameters = "
        f"{per_param}), against 16 in the V100 rows. The profiles predate the cost file's "
        "`grad` field, so the gradient the two bi replicas sum is taken as "
        f"{BF16_GRAD_BYTES} bytes per parameter (the fp32 `main_grad` megatron-core's DDP "
        f"accumulates), {BF16_GRAD_BYTES}/{BF16_STATE_BYTES} of `param`.",
        "- **The replica-gradient sum** of bi (Chimera-style and PRT alike) is simulated: "
        "after its last backward each rank sends its stages' gradients to the mirrored rank "
        "P−1−r over the same link as the pipeline's messages (one latency, bytes over the "
        "link's bandwidth, no contention with other pairs) and adds what it receives at a "
        f"third of the H200's {H200_HBM_BANDWIDTH / 1e12:g} TB/s HBM3e bandwidth (two reads, "
        "one write); a pair starts when both ranks are done. On `free` it is free too. The "
        "V100 rows leave it out.",
        "- **Links** (per direction; latencies are our assumption):",
        *(f"  - `{k}`: {LINKS[k].label}" for k in H200_LINKS),
        "  NVLink 4 on an H100/H200 SXM is 900 GB/s in total both ways per GPU over 18 "
        "links, i.e. 450 GB/s each way; through the NVSwitch of an 8-GPU HGX board one "
        "pair of GPUs can use all of it. PCIe 5.0 x16 is 32 GT/s x 16 lanes with 128b/130b "
        "encoding, 63 GB/s each way before protocol overheads (optimistic, as on V100).",
        "- **Everything else** as above: P = 8, the runtime's even split of the layers "
        "(except in the subsection on balanced splits), "
        "the same baselines and plan candidates (`candidate_plans`); (!) marks a peak over "
        f"the H200's {H200_MEMORY / 1e9:.0f} GB.",
    ]


def _h200_rest(results: Results, s: Settings) -> list[str]:
    link = LINKS[H200_MAIN_LINK]
    lines = [
        *h200_causes(results, s),
        "",
        "### Against the paper, beside the V100 FLOP model",
        "",
        f"Gains (uni: PRT over 1F1B; bi: PRT over Chimera-style bi); V100 on `{MAIN_LINK}`, "
        f"H200 on `{H200_MAIN_LINK}` with the replica-gradient sum.",
        "",
        *side_by_side(results, s),
        "",
        "### The profiles",
        "",
        "Means over the layers; *head ÷ layer* compares forward + backward; a hop is one "
        "message between neighbouring ranks.",
        "",
        *profile_rows(s.h200_names),
        "",
        f"### Iteration time, bubble and memory (P = 8, link: {link.label}, replica sum on)",
        "",
        *main_table(results, s.h200_names, H200_MAIN_LINK, s.microbatches, True),
        "",
        *balanced_section(results, s),
    ]
    if len(s.h200_links) > 1:
        lines += [
            "### Gain by link (replica sum on)",
            "",
            *h200_link_table(results, s),
            "",
        ]
    lines += [
        "### The replica-gradient sum",
        "",
        "bi iteration times without and with the sum (in brackets: what it adds, ms).",
        "",
        *replica_table(results, s),
        "",
        f"### Every candidate (iteration ms, `{H200_MAIN_LINK}`, replica sum on)",
        "",
        *candidates_table(results, s.h200_names, H200_MAIN_LINK, s.microbatches, s.reuses, True),
        "",
    ]
    return lines


def balanced_section(results: Results, s: Settings) -> list[str]:
    rows = [o for j, o in results.items() if j.partition == "balanced"]
    kept = sum(o.search.startswith("even split kept") for o in rows)
    exact = sorted({f"{o.job.model} {o.job.variant.label}" for o in rows if o.search == "exact"})
    return [
        f"### Balanced splits: the partitioner's fastest (`{H200_MAIN_LINK}`)",
        "",
        "Every row above uses the runtime's even split, which leaves the head on the last "
        "stage with that stage's share of the layers. Here the stage layers come from the "
        "partitioner, `megatron_prt.tune.partition.partition(cost, placement, m, "
        f"budget_bytes={H200_MEMORY:.3g}, schedule=...)`: its time objective, the fastest "
        f"partition it finds within an H200's {H200_MEMORY / 1e9:.0f} GB (every split here "
        "peaks far below, so: the fastest it finds; its default objective is the least "
        f"memory within {DEFAULT_SLACK:.0%} of the fastest). 1F1B gets the same treatment, "
        "since megatron-core runs uneven stages too (fewer layers on the head's stage, "
        "say), so *PRT balanced vs 1F1B balanced* compares like with like. The search is "
        f"exact where there are at most {EXHAUSTIVE_LIMIT} admissible splits "
        f"({', '.join(exact) or 'no row here'}) and a local search otherwise, without an "
        "optimality guarantee. It times splits on the "
        "runtime's plan (built for uniform stages) without the replica sum; each row then "
        "times its split like every other row (the plan built for its costs and the "
        "runtime's, the faster kept), and keeps the even split when that is faster "
        f"({kept} of {len(rows)} rows). Peaks: the largest per-rank peak, activations from "
        "the plan + the profile's parameter bytes.",
        "",
        *balanced_gain_table(results, s),
        "",
        *balanced_rows(results, s),
        "",
    ]


def h200_causes(results: Results, s: Settings) -> list[str]:
    m = 8 if 8 in s.microbatches else s.microbatches[0]
    reuse = max(s.reuses)
    first = PROFILES[s.h200_names[0]]
    layer = mean_layer(profiled(first.name))
    v_layer, _ = v100_layer(first.name)
    k4, k5 = LINKS["nvlink4"], LINKS["pcie5"]
    heads, spread = [], []
    for n in s.h200_names:
        cost = profiled(n)
        heads.append(f"{work(cost.head) / work(mean_layer(cost)):.1f} ({PROFILES[n].v100})")
        model = models()[PROFILES[n].v100]
        one, many = Placement(RANKS, 1), Placement(RANKS, reuse)
        mine = [rank_imbalance(profiled_cost(n, p, k4, False), p) for p in (one, many)]
        flop = [rank_imbalance(cost_model(model, p, k4), p) for p in (one, many)]
        spread.append(
            f"{PROFILES[n].v100} {mine[0]:.2f} → {mine[1]:.2f} (V100 rows {flop[0]:.2f} → "
            f"{flop[1]:.2f})"
        )
    _, v_head = v100_layer(first.name)
    lines = [
        f"Where the H200 costs change the picture (m = {m}):",
        "",
        f"- **The head weighs.** The profiled head costs as much as {' and '.join(heads)} "
        f"layers (forward + backward); the V100 rows' classifier "
        f"{work(v_head) / work(v_layer):.1g}. The even split puts it on stage D−1 with that "
        "stage's layers, and reuse cannot split one unit: the busiest rank's compute over "
        f"the mean rank's, 1F1B → R = {reuse} loop, is {'; '.join(spread)}. Every schedule "
        "pays at least m times that rank's load, so there is less bubble for reuse to "
        f"take: with free communication PRT uni gains {h200_gains(results, s, 'free', m, 'uni')} "
        f"over 1F1B, against {v100_gains(results, s, 'free', m, 'uni')} in the V100 rows.",
        f"- **Messages are cheap on NVLink 4.** A {first.v100} hop is "
        f"{1e3 * hop_ms(profiled(first.name).message_bytes, k4):.0f} µs, "
        f"{hop_ms(profiled(first.name).message_bytes, k4) / layer.fwd:.1%} of a layer's "
        "forward (V100 rows on one NVLink 2.0 link: "
        f"{hop_ms(models()[first.v100].layers[0].out_bytes, LINKS[MAIN_LINK]) / v_layer.fwd:.1%}"
        f"); on `pcie5` {hop_ms(profiled(first.name).message_bytes, k5) / layer.fwd:.1%}, "
        "about the V100 NVLink ratio. Gains by link, "
        f"{' → '.join(f'`{k}`' for k in s.h200_links)}: "
        + "; ".join(link_chain(results, s, n, m, d) for n in s.h200_names for d in ("uni", "bi"))
        + ".",
        *replica_note(results, s, m),
        f"- **Against the V100 rows and the paper** (m = {m}, `{H200_MAIN_LINK}` with the "
        f"replica sum): PRT uni {h200_gains(results, s, H200_MAIN_LINK, m, 'uni')} over 1F1B "
        f"(V100 rows on `{MAIN_LINK}`: {v100_gains(results, s, MAIN_LINK, m, 'uni')}; paper "
        f"{PAPER_GAINS[('BERT', 'uni')]:+.2%}), PRT bi "
        f"{h200_gains(results, s, H200_MAIN_LINK, m, 'bi')} over Chimera-style bi (V100 rows: "
        f"{v100_gains(results, s, MAIN_LINK, m, 'bi')}; paper "
        f"{PAPER_GAINS[('BERT', 'bi')]:+.2%}).",
        *balanced_note(results, s, m),
    ]
    return lines


def balanced_note(results: Results, s: Settings, m: int) -> list[str]:
    """What the partitioner's fastest split does to the uni gains (quoted numbers only)."""
    if not any(j.partition == "balanced" for j in results):
        return []
    at_m, spans = [], []
    for n in s.h200_names:
        own, vs_even, vs_bal = balanced_gains(results, n, m)
        at_m.append(
            f"{PROFILES[n].v100}: 1F1B itself {pct(own)} faster, PRT uni "
            f"{h200_gain(results, n, H200_MAIN_LINK, m, 'uni')} → {pct(vs_even)} over 1F1B "
            f"even and {pct(vs_bal)} over 1F1B balanced"
        )
        others = [balanced_gains(results, n, mb)[2] for mb in s.microbatches if mb != m]
        if others:
            spans.append(f"{PROFILES[n].v100} {pct(min(others))} to {pct(max(others))}")
    text = (
        "- **With the partitioner's fastest split for both** (subsection below; "
        f"m = {m}), fewer layers on the head's stage: {'; '.join(at_m)}."
    )
    if spans:
        text += " At the other m, PRT balanced over 1F1B balanced: " + ", ".join(spans) + "."
    return [text]


def replica_note(results: Results, s: Settings, m: int) -> list[str]:
    paid = [k for k in s.h200_links if not math.isinf(LINKS[k].bandwidth)]
    if not paid:
        return []
    sums, shifts = [], []
    for n in s.h200_names:
        for k in paid:
            c = results.compare(n, k, m, "bi", True)
            sums.append(
                f"{c.baseline.replica_ms:.2f} ms ({c.baseline.replica_ms / c.baseline.ms:.1%} "
                f"of Chimera-style bi's iteration; {PROFILES[n].v100}, `{k}`)"
            )
            for mb in s.microbatches:
                on, off = (results.compare(n, k, mb, "bi", x).gain for x in (True, False))
                shifts.append(abs(on - off))
    mib = ", ".join(f"{replica_mib(n, 1):.0f} MiB ({PROFILES[n].v100})" for n in s.h200_names)
    return [
        "- **The replica-gradient sum is small.** The busiest rank sends its mirrored rank "
        f"{mib} of fp32 gradients under Chimera-style bi; at m = {m} the sum adds "
        f"{'; '.join(sums)}. Chimera-style and PRT bi both pay it, so it moves the PRT bi "
        f"gain by at most {100 * max(shifts):.1f} points over every m and link below.",
    ]
