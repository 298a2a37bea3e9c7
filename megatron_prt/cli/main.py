"""``megatron-prt`` console script: plan, simulate and compare PRT schedules."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from ..core.grid import format_grid
from ..core.lower import lower
from ..core.placement import DIRECTIONS, PLACEMENTS, ConfigError, Placement
from ..core.plan import Plan
from ..core.schedules import SCHEDULES, build_plan
from ..core.timing import StageTimes
from ..core.validate import validate
from ..core.zerobubble import MEM_CAPS, zero_bubble
from ..megatron.args import positive_int
from ..sim.cost import CostModel
from ..sim.model_shape import differences_message
from ..sim.recompute import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS
from ..sim.render import ascii_grid, spans_of, write_chrome_trace, write_png
from ..sim.simulate import SimResult, simulate
from ..tune.memory import parse_bytes
from ..tune.plan_file import describe_recompute, load_plan, recompute_of
from .layers import check_even_split


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, lambda value: value > 0, "> 0")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _number(text, lambda value: value >= 0, ">= 0")


def _fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    return _number(text, lambda value: 0 <= value <= 1, "in [0, 1]")


def probability(text: str) -> float:
    """argparse type: a probability in [0, 1) (e.g. megatron's dropout)."""
    return _number(text, lambda value: 0 <= value < 1, "in [0, 1)")


def _number(text: str, accept, bound: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not accept(value):
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
    return value


def mem_cap(text: str) -> str | float:
    """argparse type: a named activation cap or bytes > 0 as the byte flags take them
    (``2.5e9``, ``24GiB``: :func:`megatron_prt.tune.memory.parse_bytes`)."""
    if text in MEM_CAPS:
        return text
    try:
        return parse_bytes(text)
    except ValueError:  # its message lists bytes alone
        raise argparse.ArgumentTypeError(
            f"must be {', '.join(MEM_CAPS)} or bytes > 0 (2.5e9, 24GiB, 512MiB), got {text!r}"
        ) from None


def split_flags(p: argparse.ArgumentParser, cap: bool = True) -> None:
    p.add_argument(
        "--split-backward",
        action="store_true",
        help="split every backward into input-gradient (I) and weight-gradient (W) work and "
        "let W fill the bubbles (zero-bubble plans, schedule zb)",
    )
    if cap:
        p.add_argument(
            "--mem-cap",
            type=mem_cap,
            default=None,
            help="split backward: most activation bytes a rank may hold, priced with the "
            "costs' activation bytes: 1f1b (what plain 1F1B holds on its busiest rank), zb-h2 "
            "(about twice that) or a number. Without it: the plan the runtime and megatron "
            "run, built for equal stages and capped at 1F1B's activation count (zb) or twice "
            "it (zb-h2)",
        )


# the plan's shape flags and their defaults; simulate parses them as None so that a given one
# can be told from a default (--plan refuses them: the file has its own)
SHAPE_DEFAULTS = {"reuse": 1, "placement": "loop", "direction": "uni", "schedule": "prt"}


def _plan_flags(p: argparse.ArgumentParser, required: bool = True) -> None:
    shape = SHAPE_DEFAULTS if required else dict.fromkeys(SHAPE_DEFAULTS)
    p.add_argument("--pp", type=positive_int, required=required, help="pipeline ranks P")
    p.add_argument(
        "--reuse", type=positive_int, default=shape["reuse"], help="virtual stages per rank R"
    )
    p.add_argument("--placement", choices=PLACEMENTS, default=shape["placement"])
    p.add_argument("--direction", choices=DIRECTIONS, default=shape["direction"])
    p.add_argument(
        "--microbatches", "-m", type=positive_int, required=required, help="micro-batches m"
    )


def cost_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("costs (whole model, one micro-batch; any time unit)")
    g.add_argument("--fwd-time", type=positive_float, help="forward time (default 1)")
    g.add_argument("--bwd-time", type=non_negative_float, help="backward time (default 2)")
    g.add_argument(
        "--wgrad-fraction",
        type=_fraction,
        help="share of the backward time that is weight-gradient (W) work (default 0.5)",
    )
    g.add_argument(
        "--p2p-time",
        type=non_negative_float,
        help="latency of one p2p hop (default 0): the cost file's p2p_latency; each cut's "
        "message (its entries' out_bytes, else message_bytes) / p2p_bandwidth, where it "
        "gives them, add to it",
    )
    g.add_argument(
        "--replica-sync-time",
        type=non_negative_float,
        default=None,
        help="bi: the fixed part of the time two mirrored ranks take to exchange and sum "
        "their replica gradients after the step (the cost file's replica_latency; default "
        "0); the cost file's replica_bandwidth and replica_add_bandwidth add their bytes' "
        "time to it. The same figures price a cost file's tied_grad_bytes (the tied "
        "embedding's sum between first and last stages, uni too)",
    )
    g.add_argument("--costs", metavar="FILE", help="cost model JSON (flags above override it)")
    recompute_flags(g)
    p.add_argument(
        "--plan-from-costs",
        action="store_true",
        help="plan from the costs' stage and message times instead of equal stages and free "
        "messages; the runtime and the megatron integration do not run such a plan, so by "
        "default the prediction is for the plan they run",
    )


PRICE_RECOMPUTE = (
    "price megatron's activation recomputation: recomputed layers keep less and their "
    "backward reruns the forward (default: the cost file's setting; none: off)"
)


def recompute_flags(p, granularity_help: str = PRICE_RECOMPUTE) -> None:
    """megatron's activation-recomputation flags (same names and rules); any of them replaces
    the cost file's setting (:mod:`megatron_prt.sim.cost`, "Activation recomputation");
    ``granularity_help`` says what the command does with them."""
    p.add_argument(
        "--recompute-granularity",
        choices=(*RECOMPUTE_GRANULARITIES, "none"),
        help=granularity_help,
    )
    p.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, help="with full")
    p.add_argument(
        "--recompute-num-layers",
        type=positive_int,
        metavar="N",
        help="with full: layers per uniform block, or recomputed layers per stage (block)",
    )


def with_recompute_flags(cost: CostModel, args) -> CostModel:
    """``cost`` under the ``--recompute-*`` flags when any is given."""
    flags = (args.recompute_granularity, args.recompute_method, args.recompute_num_layers)
    if flags == (None, None, None):
        return cost
    return cost.with_recompute(None if flags[0] == "none" else flags[0], *flags[1:])


def recompute_label(cost: CostModel) -> str:
    """``full/uniform/1``, ``selective`` or ``none``: the setting a report priced."""
    setting = (cost.recompute_granularity, cost.recompute_method, cost.recompute_num_layers)
    return "/".join(str(part) for part in setting if part is not None) or "none"


def load_costs(path: str, flag: str = "--costs", args=None) -> CostModel:
    """:meth:`CostModel.load` with the flag that named ``path`` in the error; under
    ``args``' ``--recompute-*`` flags when given."""
    try:
        cost = CostModel.load(path)
    except ConfigError as exc:
        raise ConfigError(f"{flag} {exc}") from exc
    return cost if args is None else with_recompute_flags(cost, args)


def cost_from_args(args) -> CostModel:
    data = load_costs(args.costs).to_dict() if args.costs else {}
    overridden = [
        f"--{f.replace('_', '-')}" for f in ("fwd_time", "bwd_time") if getattr(args, f) is not None
    ]
    if data.get("layers") and overridden:  # the layers' own times price the stages
        raise ConfigError(
            f"{', '.join(overridden)} with --costs {args.costs}, which gives per-layer times: "
            "they would be ignored; drop them, or scale the file's layers"
        )
    ends = ("embedding", "head", "stage")
    entries = [*data.get("layers", ()), *(data[k] for k in ends if data.get(k))]
    own_wgrad = entries and all(entry.get("wgrad") is not None for entry in entries)
    # a --mem-cap plan for equal stages is built with the fraction, whatever the entries give
    equal_stages = getattr(args, "mem_cap", None) is not None and not getattr(
        args, "plan_from_costs", False
    )
    if own_wgrad and not equal_stages and getattr(args, "wgrad_fraction", None) is not None:
        raise ConfigError(
            f"--wgrad-fraction with --costs {args.costs}, whose every layer gives its own "
            "wgrad: it would be ignored; drop it, or the file's wgrad entries"
        )
    for flag, key in (
        ("fwd_time", "fwd_time"),
        ("bwd_time", "bwd_time"),
        ("wgrad_fraction", "wgrad_fraction"),
        ("p2p_time", "p2p_latency"),
        ("replica_sync_time", "replica_latency"),
    ):
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
    return with_recompute_flags(CostModel.from_dict(data), args)


def planning_times(args, cost: CostModel, placement: Placement) -> StageTimes | None:
    """Stage times the plan is built for: ``None`` (equal stages, free messages, as
    :class:`megatron_prt.runtime.PipelineRuntime` users and the megatron integration call
    :func:`build_plan`) unless ``--plan-from-costs``."""
    return cost.stage_times(placement) if args.plan_from_costs else None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megatron-prt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="generate, validate and show a plan")
    _plan_flags(p)
    p.add_argument("--schedule", choices=SCHEDULES, default="prt")
    split_flags(p)
    p.add_argument("--format", choices=("text", "json", "csv", "chrome", "png"), default="text")
    p.add_argument("--lowered", action="store_true", help="include SEND/RECV actions")
    p.add_argument("-o", "--output", help="write to FILE (required for png)")
    cost_flags(p)

    s = sub.add_parser("simulate", help="predict time, bubble, memory and traffic of a plan")
    _plan_flags(s, required=False)
    s.add_argument(
        "--plan",
        metavar="FILE",
        help="simulate this plan file (`megatron-prt tune -o FILE`) with its own partition, "
        "instead of --pp/--reuse/--placement/--direction/--microbatches/--schedule",
    )
    s.add_argument("--schedule", choices=SCHEDULES, default=None)
    split_flags(s)
    s.add_argument("--json", action="store_true", help="print metrics as JSON")
    cost_flags(s)

    from . import compare, partition, profile, tune

    compare.add_parser(sub).set_defaults(func=compare.run)
    partition.add_parser(sub).set_defaults(func=partition.run)
    profile.add_parser(sub)
    tune.add_parser(sub)

    from . import bench  # measured benchmark (torch loads only when it runs)

    bench.add_parser(sub)
    return parser


def check_cost_stage_layers(args, cost: CostModel, depths: set[int]) -> None:
    """A cost file's ``stage_layers`` fix the split for one depth D = R*P: refuse others
    here, naming the file, rather than deep in the simulator."""
    given = len(cost.stage_layers)
    if not given or depths == {given}:
        return
    runs = " and ".join(map(str, sorted(depths)))
    fix = (  # compare runs several depths (1F1B's P beside R*P): one split fits one of them
        "drop stage_layers from the file" if len(depths) > 1
        else f"drop stage_layers from the file or choose --pp and --reuse with R*P = {given}"
    )  # fmt: skip
    raise ConfigError(
        f"--costs {args.costs}: stage_layers splits the layers over {given} stages, but this "
        f"runs D = R*P = {runs}; {fix}"
    )


def _make_plan(args, cost: CostModel) -> Plan:
    placement = Placement(args.pp, args.reuse, args.placement, args.direction)
    check_cost_stage_layers(args, cost, {placement.depth})
    check_even_split(cost, placement.depth, args.costs)
    schedule = _schedule(args)
    if schedule == "zb-h2" and args.mem_cap not in (None, "zb-h2"):
        raise ConfigError(
            f"--schedule zb-h2 is zb under --mem-cap zb-h2; --mem-cap {args.mem_cap} would "
            "build a zb plan: give --schedule zb with --mem-cap, or drop --mem-cap"
        )
    if args.mem_cap is not None and schedule not in SPLIT_SCHEDULES:
        raise ConfigError(
            f"--mem-cap caps split-backward plans, not --schedule {schedule}; add "
            "--split-backward or drop --mem-cap"
        )
    if schedule == "interleaved" and placement.reuse == 1:
        raise ConfigError(
            "--schedule interleaved with R = 1 is 1F1B; give --reuse R >= 2 (model chunks per "
            "rank) or --schedule 1f1b"
        )
    lowered = getattr(args, "lowered", False)  # lowering orders messages by the costs' times
    if args.plan_from_costs and schedule not in TIMED_SCHEDULES and not lowered:
        raise ConfigError(
            f"--plan-from-costs with --schedule {schedule}, whose order does not depend on "
            f"the costs; drop it, or use --schedule {' or '.join(TIMED_SCHEDULES)}"
        )
    plan = build(args, cost, placement, schedule)
    validate(plan)
    return plan


# schedules whose order is built for the stage times they are given
TIMED_SCHEDULES = ("prt", "gpipe", "zb", "zb-h2")


SPLIT_SCHEDULES = ("zb", "zb-h2")


def _schedule(args) -> str:
    """``--schedule``, with ``--split-backward`` turning the default into ``zb``."""
    if not args.split_backward or args.schedule in SPLIT_SCHEDULES:
        return args.schedule
    if args.schedule != "prt":
        raise ConfigError(
            f"--split-backward plans with the zb generator, not --schedule {args.schedule}; "
            "drop --schedule (or give --schedule zb)"
        )
    return "zb"


def build(args, cost: CostModel, placement: Placement, schedule: str) -> Plan:
    """:func:`build_plan`, the plan the runtime and megatron run, unless ``--plan-from-costs``
    or ``--mem-cap`` ask for another: then split-backward plans are sized with the cost
    model (its stage activation bytes and W's share of them, ``stage_wgrad_keep``, for the
    memory cap; its times, or equal stages with its ``wgrad_fraction``, for the order)."""
    times = planning_times(args, cost, placement)
    explicit_cap = getattr(args, "mem_cap", None)
    if schedule not in SPLIT_SCHEDULES or (times is None and explicit_cap is None):
        return build_plan(placement, args.microbatches, schedule, times)
    # [Note: the split form's own costs] in sim/layer_cost.py
    times = planning_times(args, cost.split_form(), placement)
    if times is None:  # equal stages with the costs' W share, under the cap asked for
        times = StageTimes.uniform(placement.depth)
        if cost.wgrad_fraction is not None:
            times = times.with_wgrad_fraction(cost.wgrad_fraction)
    cap = explicit_cap or ("zb-h2" if schedule == "zb-h2" else "1f1b")
    return zero_bubble(
        placement,
        args.microbatches,
        times,
        mem_cap=cap,
        act=cost.stage_activation_bytes(placement),
        keep=cost.stage_wgrad_keep(placement),
    )


def cmd_plan(args) -> int:
    cost = cost_from_args(args)
    plan = _make_plan(args, cost)
    if args.lowered:
        planned = cost.split_form() if plan.split_backward else cost
        plan = lower(plan, planning_times(args, planned, plan.placement))
        validate(plan)
    try:
        return _write_plan(args, plan, cost)
    except BrokenPipeError:
        raise  # stdout closed early (`| head`): main stops quietly
    except OSError as exc:  # -o FILE in a missing or read-only directory
        raise ConfigError(
            f"-o {args.output}: {exc.strerror or exc}; choose a file in a writable directory"
        ) from exc


def _write_plan(args, plan: Plan, cost: CostModel) -> int:
    fmt = args.format
    if fmt == "png":
        if not args.output:
            raise ConfigError("--format png needs -o FILE")
        result = simulate(plan, cost)
        spans = spans_of(plan, result.timeline)
        try:
            write_png(args.output, spans, _title(plan, result), plan.placement.stage_to_chunk)
        except RuntimeError as exc:  # matplotlib missing: one line, as every refusal
            raise ConfigError(f"--format png: {exc}, or use --format chrome") from None
        print(f"wrote {args.output}")
        return 0
    if fmt == "chrome":
        result = simulate(plan, cost)
        out = args.output or "/dev/stdout"
        # profiled costs (a recorded model shape) are seconds; hand-given ones are read as ms
        unit_us = 1e6 if cost.model is not None else 1e3
        spans = spans_of(plan, result.timeline)
        write_chrome_trace(out, spans, plan.placement.stage_to_chunk, unit_us=unit_us)
        if args.output:
            print(f"wrote {args.output}")
        return 0
    text = {"json": plan.to_json, "csv": plan.to_csv, "text": lambda: _plan_text(plan, cost)}[fmt]()
    if args.output:
        with open(args.output, "w") as f:
            f.write(text if text.endswith("\n") else text + "\n")
        print(f"wrote {args.output}")
    else:
        print(text)
    return 0


def _title(plan: Plan, result: SimResult) -> str:
    c = plan.placement
    return (
        f"{plan.schedule}: P={c.ranks} R={c.reuse} {c.placement}/{c.direction} "
        f"m={plan.num_microbatches}  bubble {result.bubble_fraction:.1%}"
    )


def _plan_text(plan: Plan, cost: CostModel) -> str:
    result = simulate(plan, cost)
    steps = max(len(a) for a in plan.ranks)
    return "\n".join(
        [
            _title(plan, result),
            "",
            "order (rank x step):",
            format_grid(plan.ranks, {}, center=0, radius=steps),
            "",
            "timeline:",
            ascii_grid(spans_of(plan, result.timeline)),
        ]
    )


def _metrics_text(result: SimResult, seconds: bool = False) -> str:
    """The simulation in words; ``seconds``: the costs are a profile's (times in s)."""
    bi = result.plan.placement.direction == "bi"
    rows = [
        _title(result.plan, result),
        f"makespan        {result.makespan:.6g}" + (" s" if seconds else ""),
        f"bubble fraction {result.bubble_fraction:.4f}",
        f"p2p messages    {result.p2p_messages}  ({result.p2p_bytes:.6g} bytes)",
    ]
    if bi:
        rows.append(
            f"replica sync    {result.replica_sync_time:.6g} added to the makespan  "
            f"({result.replica_bytes:.6g} gradient bytes sent)"
        )
    tied = result.tied_sync_time > 0
    if tied:
        rows.append(f"tied emb sum    {result.tied_sync_time:.6g} added to the makespan")
    header = "rank  busy        idle        peak_inflight  peak_act_bytes  param_bytes"
    header += ("  replica_wait  replica_sync" if bi else "") + ("  tied_wait   tied_sync" * tied)
    rows += ["", header]
    for r in result.per_rank:
        row = (
            f"{r.rank:<5} {r.busy:<11.6g} {r.idle:<11.6g} {r.peak_inflight:<14} "
            f"{r.peak_activation_bytes:<15.6g} {r.param_bytes:<11.6g}"
        )
        row += f"  {r.replica_wait:<13.6g} {r.replica_sync:<12.6g}" if bi else ""
        row += f"  {r.tied_wait:<11.6g} {r.tied_sync:.6g}" if tied else ""
        rows.append(row.rstrip())
    return "\n".join(rows)


def cmd_simulate(args) -> int:
    cost = cost_from_args(args)
    if args.plan:
        plan, cost = _plan_from_file(args, cost)
    elif args.pp is None or args.microbatches is None:
        raise ConfigError("simulate needs --pp and --microbatches, or --plan FILE")
    else:
        for key, default in SHAPE_DEFAULTS.items():
            setattr(args, key, default if getattr(args, key) is None else getattr(args, key))
        plan = _make_plan(args, cost)
    counts = cost.layer_counts(plan.placement.depth) if cost.layers else ()
    if counts and not cost.runs_whole_blocks(counts):
        raise ConfigError(
            f"stages of {list(counts)} layers: megatron's uniform recomputation runs whole "
            f"blocks of --recompute-num-layers {cost.recompute_num_layers} per model stage and "
            "refuses this split; "
            + (
                f"tune again with these --recompute-* flags (the split of --plan {args.plan} "
                "is the file's)"
                if args.plan
                else "give the cost file stage_layers in whole blocks (megatron-prt "
                "partition picks one) or another --recompute-num-layers"
            )
        )
    result = simulate(plan, cost)
    text = _metrics_text(result, seconds=cost.model is not None)
    print(json.dumps(result.to_dict(), indent=1) if args.json else text)
    return 0


def _plan_from_file(args, cost: CostModel) -> tuple[Plan, CostModel]:
    """The plan file's plan, and ``cost`` split as the file splits the layers."""
    shaping = [f"--{key.replace('_', '-')}" for key in SHAPE_DEFAULTS if getattr(args, key)]
    shaping += [f for f, on in (("--split-backward", args.split_backward),
                                ("--mem-cap", args.mem_cap is not None),
                                ("--plan-from-costs", args.plan_from_costs)) if on]  # fmt: skip
    if shaping:
        raise ConfigError(
            f"{', '.join(shaping)} with --plan {args.plan}: the plan file fixes the schedule "
            "and its shape; drop them, or simulate without --plan"
        )
    plan_file = load_plan(args.plan)
    for flag, given, own in (
        ("--pp", args.pp, plan_file.plan.placement.ranks),
        ("--microbatches", args.microbatches, plan_file.plan.num_microbatches),
    ):
        if given is not None and given != own:
            raise ConfigError(
                f"{flag} {given} disagrees with --plan {args.plan}, which has {own}; drop {flag}"
            )
    if not cost.layers:
        split = ",".join(map(str, plan_file.stage_layers))
        print(
            f"megatron-prt simulate: note: no per-layer --costs, so the stages are priced "
            f"equal, not as the file splits the layers ({split}); give the cost file the plan "
            "was tuned with",
            file=sys.stderr,
        )
        return plan_file.plan, cost
    if len(cost.layers) != plan_file.num_layers:
        raise ConfigError(
            f"--plan {args.plan} splits {plan_file.num_layers} layers but --costs "
            f"{args.costs} describes {len(cost.layers)}; tune with this cost file"
        )
    note = differences_message(
        f"--plan {args.plan} was tuned on costs of", plan_file.model, cost.model,
        f"simulated with --costs {args.costs} as given", sides="plan -> costs",
    )  # fmt: skip
    if note is not None:
        print(f"megatron-prt simulate: note: {note}", file=sys.stderr)
    return plan_file.plan, _tuned_recompute(args, plan_file, cost)


def _tuned_recompute(args, plan_file, cost: CostModel) -> CostModel:
    """``cost`` split as the file splits the layers, under the recomputation the file was
    tuned with unless ``--recompute-*`` flags say otherwise (simulate priced the file's
    plan without it and disagreed with what tune printed)."""
    cost = replace(cost, stage_layers=plan_file.stage_layers)
    flags = (args.recompute_granularity, args.recompute_method, args.recompute_num_layers)
    tuned = plan_file.recompute
    if tuned is None or flags != (None, None, None) or tuple(recompute_of(cost)) == tuned:
        return cost
    print(
        f"megatron-prt simulate: note: priced with the recomputation --plan {args.plan} was "
        f"tuned with ({describe_recompute(tuned)}); give --recompute-* flags to price another",
        file=sys.stderr,
    )
    return cost.with_recompute(*tuned)


def check_output(path: str | None, example: str) -> None:
    """Refuse an unwritable ``-o`` before minutes of work, not after (:class:`ConfigError`
    naming the file and the fix; ``example`` a file name for a directory given instead)."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(
            f"-o {path}: directory {directory} does not exist or is not writable; create it "
            "or choose another FILE"
        )
    if os.path.isdir(path):
        raise ConfigError(f"-o {path} is a directory; give a file name such as {path}/{example}")


COMMANDS = {"plan": cmd_plan, "simulate": cmd_simulate}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args) if args.command in COMMANDS else args.func(args)
    except ConfigError as exc:
        print(f"megatron-prt: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `| head` stopped reading: stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 1
