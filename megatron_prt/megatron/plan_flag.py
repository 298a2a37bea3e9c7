"""``--pipeline-reuse-plan FILE``: run a plan file (``megatron-prt tune -o FILE``) as it is.

The file fixes P, R, placement, direction, the layer split and the micro-batches per
iteration. :func:`apply_plan_file` checks them against the model's flags before anything
else and writes the file's values into ``args`` so the rest of the validation sees one
consistent setting. A ``--pipeline-reuse-*`` flag left out takes the file's value; one given
with a value other than the file's is refused (it cannot be told which the user meant). The
placement and direction flags, whose defaults are values a file may contradict, note that they
were given (:class:`NotedStore`), so ``--pipeline-reuse-placement loop`` beside a wave plan is
refused too; on a namespace built without the parser (no note), only a value away from the
default can be seen to be given.

Imports neither torch nor megatron, like :mod:`megatron_prt.megatron.args`.
"""

from __future__ import annotations

import argparse
import os
import warnings

from ..core.placement import ConfigError
from ..sim.model_shape import default_ffn, differences_message, dtype_name
from ..tune.plan_file import PlanFile, describe_recompute, load_plan, recompute_setting

FLAG = "--pipeline-reuse-plan"
GIVEN = "pipeline_reuse_given"  # the args attribute NotedStore keeps the given dests in


def is_first_launched() -> bool:
    """Whether this process is rank 0 of its launch (torchrun's ``RANK``; a process started
    without a launcher is). Flags are checked before ``torch.distributed`` starts, on every
    rank alike, so what they say is said by this one rank, not once per rank."""
    return int(os.environ.get("RANK", "0")) == 0


def warn_once(message: str, stacklevel: int = 2) -> None:
    """``warnings.warn(message)`` on the launch's first rank only (:func:`is_first_launched`)."""
    if is_first_launched():
        warnings.warn(message, stacklevel=stacklevel + 1)


class NotedStore(argparse.Action):
    """``store`` that also notes its ``dest`` in ``args.pipeline_reuse_given`` (a sorted
    tuple: Megatron-LM saves ``args`` in checkpoints and loads them with ``weights_only``,
    which refuses a frozenset), so a flag given as its own default is told from one left
    out."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        given = {*getattr(namespace, GIVEN, ()), self.dest}
        setattr(namespace, GIVEN, tuple(sorted(given)))


def add_plan_argument(group) -> None:
    """Add ``--pipeline-reuse-plan`` to the PRT flags' argument group."""
    group.add_argument(
        FLAG,
        default=None,
        metavar="FILE",
        help="Run this plan file (megatron-prt tune -o FILE) as it is: its R, placement, "
        "direction and layer split replace the other --pipeline-reuse-* flags (one given "
        "with another value is refused); checked against --num-layers, "
        "--pipeline-model-parallel-size and the micro-batches per iteration.",
    )


def apply_plan_file(
    args: argparse.Namespace, defaults: dict, microbatches: int | None
) -> PlanFile | None:
    """Load ``args.pipeline_reuse_plan`` (``None``: no file, nothing done), refuse every
    mismatch with the model and conflicting flag (:class:`ConfigError` naming both and
    the fix), then set ``--pipeline-reuse``, ``-placement``, ``-direction``,
    ``-stage-layers`` and ``-split-backward`` from the file. ``defaults``: the dependent
    flags' defaults;
    ``microbatches``: per iteration as the flags give it (``None``: not known yet, then
    the schedule checks it at the first call)."""
    path = getattr(args, "pipeline_reuse_plan", None)
    if path is None:
        return None
    plan_file = load_plan(path, FLAG)
    where = f"{FLAG} {path}"
    _check_model(args, plan_file, where, microbatches)
    _check_flags(args, plan_file, where, defaults)
    _warn_other_recompute(args, plan_file, where)
    warn_other_shape(
        args, plan_file.model, f"{where} was tuned for",
        "the plan runs as written, but its time and memory are not what tune predicted; "
        "profile this model (`megatron-prt profile` with these flags) and tune again",
    )  # fmt: skip
    placement = plan_file.plan.placement
    args.pipeline_reuse = placement.reuse
    args.pipeline_reuse_placement = placement.placement
    args.pipeline_reuse_direction = placement.direction
    args.pipeline_reuse_stage_layers = plan_file.stage_layers
    args.pipeline_reuse_split_backward = plan_file.plan.split_backward
    return plan_file


def _check_model(
    args: argparse.Namespace, plan_file: PlanFile, where: str, count: int | None
) -> None:
    """Layers, pipeline size and micro-batches per iteration must be the file's."""
    placement = plan_file.plan.placement
    layers = getattr(args, "num_layers", None)
    if layers != plan_file.num_layers:
        raise ConfigError(
            f"{where} splits {plan_file.num_layers} layers but --num-layers is {layers}; "
            f"tune for this model (megatron-prt tune --costs FILE with its {layers} layers) "
            "or give the model the file's layer count"
        )
    ranks = getattr(args, "pipeline_model_parallel_size", 1)
    if ranks != placement.ranks:
        raise ConfigError(
            f"{where} is a plan for {placement.ranks} pipeline ranks but "
            f"--pipeline-model-parallel-size is {ranks}; use --pipeline-model-parallel-size "
            f"{placement.ranks} or tune with --pp {ranks}"
        )
    if count is not None and count != plan_file.plan.num_microbatches:
        raise ConfigError(
            f"{where} schedules {plan_file.plan.num_microbatches} micro-batches per iteration "
            f"but the flags give {count} = global batch // (--micro-batch-size * data-parallel "
            f"size); set --global-batch-size to match or tune with -m {count}"
        )


def _check_flags(args: argparse.Namespace, plan_file: PlanFile, where: str, defaults: dict) -> None:
    """A flag given (or set away from its default) with a value other than the file's is
    refused."""
    plan = plan_file.plan
    placement = plan.placement
    reuse = getattr(args, "pipeline_reuse", None)
    if reuse is not None and reuse != placement.reuse:
        _conflict(where, "--pipeline-reuse", reuse, placement.reuse)
    for dest, own in (
        ("pipeline_reuse_placement", placement.placement),
        ("pipeline_reuse_direction", placement.direction),
    ):
        given = getattr(args, dest, defaults[dest])
        named = dest in getattr(args, GIVEN, ())
        if (named or given != defaults[dest]) and given != own:
            _conflict(where, "--" + dest.replace("_", "-"), given, own)
    stage_layers = getattr(args, "pipeline_reuse_stage_layers", None)
    if stage_layers is not None and tuple(stage_layers) != plan_file.stage_layers:
        _conflict(
            where,
            "--pipeline-reuse-stage-layers",
            ",".join(map(str, stage_layers)),
            ",".join(map(str, plan_file.stage_layers)),
        )
    if getattr(args, "pipeline_reuse_split_backward", False) and not plan.split_backward:
        raise ConfigError(
            f"--pipeline-reuse-split-backward conflicts with {where}, whose plan runs whole "
            "backwards; drop the flag (the file decides) or tune again with split backward"
        )
    for dest in ("pipeline_reuse_costs", "pipeline_reuse_memory_budget"):
        if getattr(args, dest, None) is not None:
            raise ConfigError(
                f"--{dest.replace('_', '-')} and {where} both set: the plan file already "
                "holds the partition; drop the flag"
            )
    partition = getattr(args, "pipeline_reuse_partition", "uniform")
    if partition == "balanced" or "pipeline_reuse_partition" in getattr(args, GIVEN, ()):
        raise ConfigError(  # given as uniform too: the file's split would win without a word
            f"--pipeline-reuse-partition {partition} and {where} both set: the plan file "
            "already holds the partition; drop --pipeline-reuse-partition"
        )


def _warn_other_recompute(args: argparse.Namespace, plan_file: PlanFile, where: str) -> None:
    """Training under other ``--recompute-*`` flags than the file was tuned with runs the
    same plan (the order does not depend on them) at another time and memory than tune
    predicted: said, not refused."""
    tuned = plan_file.recompute
    running = recompute_setting(
        getattr(args, "recompute_granularity", None),
        getattr(args, "recompute_method", None),
        getattr(args, "recompute_num_layers", None),
        getattr(args, "recompute_activations", False),
    )
    if tuned is None or tuple(running) == tuned:
        return
    warn_once(
        f"{where} was tuned with recomputation {describe_recompute(tuned)}, this run has "
        f"{describe_recompute(running)}: the plan runs as written, but its time and memory "
        "are not what tune predicted; tune again with these --recompute-* flags",
        stacklevel=2,
    )


def running_shape(args: argparse.Namespace) -> dict:
    """The model shape the flags give (:mod:`megatron_prt.sim.model_shape` keys), as far as
    they are known before Megatron's ``validate_args``: an ``ffn_hidden_size`` left out is
    megatron's ``4 * hidden`` (not under ``--swiglu``, whose default differs). Not the
    vocabulary: megatron pads it (to ``--make-vocab-size-divisible-by``) after this check,
    and :func:`warn_other_vocabulary` compares it then. Not the tensor-parallel size: ``profile``
    measures one rank, so a tensor-parallel run is priced at its TP 1 layers (docs/tune.md),
    which no profile could change."""
    hidden = getattr(args, "hidden_size", None)
    ffn = getattr(args, "ffn_hidden_size", None)
    if hidden and not getattr(args, "swiglu", False):
        ffn = default_ffn(ffn, hidden)
    dtype = dtype_name(getattr(args, "bf16", False), getattr(args, "fp16", False))
    return {
        "hidden_size": hidden,
        "num_attention_heads": getattr(args, "num_attention_heads", None),
        "ffn_hidden_size": ffn,
        "seq_length": getattr(args, "seq_length", None),
        "micro_batch_size": getattr(args, "micro_batch_size", None),
        "dtype": dtype,
        "transformer_impl": getattr(args, "transformer_impl", None),
        "device": getattr(args, "device", None),
        "swiglu": bool(getattr(args, "swiglu", False)),
        "num_query_groups": _query_groups(args),
        "untie_embeddings_and_output_weights": bool(
            getattr(args, "untie_embeddings_and_output_weights", False)
        ),
        "hidden_dropout": getattr(args, "hidden_dropout", None),
        "attention_dropout": getattr(args, "attention_dropout", None),
    }


def _query_groups(args: argparse.Namespace) -> int | None:
    """Key/value heads: ``--num-query-groups`` under ``--group-query-attention``, else one
    per attention head (megatron's rule)."""
    if getattr(args, "group_query_attention", False):
        return getattr(args, "num_query_groups", None)
    return getattr(args, "num_attention_heads", None)


def warn_other_shape(
    args: argparse.Namespace, recorded: dict | None, what: str, consequence: str
) -> None:
    """Warn when ``recorded`` (a cost or plan file's model shape) is not the flags' model
    (said, not refused: the run is exact, only its time and memory are not as predicted).
    ``what``: the file, e.g. ``--pipeline-reuse-plan p.json was tuned for``;
    ``consequence``: what that means and the fix."""
    message = differences_message(what, recorded, running_shape(args), consequence)
    if message is not None:
        warn_once(message, stacklevel=3)


def recorded_vocabularies(
    args: argparse.Namespace, plan_file: PlanFile | None
) -> tuple[tuple[str, int], ...]:
    """``(which file, vocabulary size)`` for the plan file and the cost file the flags name,
    where their recorded model gives a size (``ReuseConfig.recorded_vocab``)."""
    return _recorded(args, plan_file, "vocab_size")


def recorded_kinds(
    args: argparse.Namespace, plan_file: PlanFile | None
) -> tuple[tuple[str, str], ...]:
    """``(which file, model kind)`` for the plan file and the cost file the flags name, where
    their recorded model gives one (``ReuseConfig.recorded_kind``)."""
    return _recorded(args, plan_file, "model")


def _recorded(args: argparse.Namespace, plan_file: PlanFile | None, key: str) -> tuple:
    from ..sim.cost import CostModel

    found = []
    if plan_file is not None:
        found.append((f"{FLAG} {args.pipeline_reuse_plan} was tuned for", plan_file.model))
    costs = getattr(args, "pipeline_reuse_costs", None)
    if costs is not None:  # already loaded once by the balanced split, so it is valid
        found.append(
            (f"--pipeline-reuse-costs {costs} was profiled on", CostModel.load(costs).model)
        )
    return tuple((what, model[key]) for what, model in found if (model or {}).get(key))


def warn_other_kind(recorded: tuple[tuple[str, str], ...], model: object) -> None:
    """Warn for each of ``recorded`` (``ReuseConfig.recorded_kind``) whose model kind is not
    the one built (``model``: a chunk, its class named ``GPTModel`` or ``BertModel``; other
    classes are not compared). Said, not refused: the run is exact, but every layer was
    priced as another model's."""
    built = {"GPTModel": "gpt", "BertModel": "bert"}.get(type(model).__name__)
    for what, kind in recorded:
        if built is not None and kind.split("-")[0] != built:
            warn_once(
                f"{what} a {kind} model, but this run builds a {built} model: the layers, "
                "the embedding and the head were priced as another model's, so the layer "
                "split and the predicted times are off; profile this model (`megatron-prt "
                "profile --model ...` with these flags) and tune or balance again",
                stacklevel=3,
            )


def warn_other_vocabulary(recorded: tuple[tuple[str, int], ...], tokens: int, padded: int) -> None:
    """Warn for each of ``recorded`` (``ReuseConfig.recorded_vocab``) whose size lies outside
    the tokenizer's ``tokens`` (less one: megatron's NullTokenizer counts its end-of-document
    token on top of ``--vocab-size``) to megatron's ``padded`` size of it: a size within the
    padding (another tensor-parallel size's) costs the same within a few rows. Called once the
    tokenizer is built: the flags' checks (:func:`warn_other_shape`) run before megatron
    knows the vocabulary. Said, not refused, as for any other shape: the run is exact, but
    the embedding and the head were priced at another size, so the balanced split and the
    predicted times are off (BERT-base's 30,522-token head computes about as much as three
    of its layers)."""
    for what, size in recorded:
        if not tokens - 1 <= size <= padded:
            warn_once(
                f"{what} a vocabulary of {size} tokens, but the tokenizer has {tokens} "
                f"(padded to {padded}): the embedding and the head were priced at another "
                f"size, so the layer split and the predicted times are off; profile with "
                f"--vocab-size {padded} (`megatron-prt profile`) and tune or balance again",
                stacklevel=3,
            )


def _conflict(where: str, flag: str, given, own) -> None:
    raise ConfigError(
        f"{flag} {given} conflicts with {where}, which has {own}; drop {flag} (the file "
        "decides) or tune again for it"
    )
