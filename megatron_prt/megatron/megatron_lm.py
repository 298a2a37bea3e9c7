"""Glue for Megatron-LM's training scripts (``pretrain_bert.py``, ``pretrain_gpt.py``; see
``patches/<tag>/``).

Megatron-LM builds its arguments inside ``pretrain()``, so this module is the one place in
megatron-prt that reads them through ``megatron.training.get_args()``; everything below it
takes a :class:`~megatron_prt.megatron.config.ReuseConfig`. A patched script passes:

* ``extra_args_provider=add_arguments`` (the ``--pipeline-reuse*`` flags), or
  ``add_arguments_and(script_provider)`` for a script with its own;
* ``get_embedding_ranks=get_embedding_ranks`` (PRT sums tied embedding gradients itself), or
  ``embedding_ranks_or(script_ranks)`` for a script with its own;
* ``model_provider(provider)`` instead of ``provider``: chunk roles and the layer layout from
  the placement, replica/tied weights prepared as chunks are built, PRT installed as the
  forward-backward function megatron's training loop looks up, megatron's per-chunk
  stage queries answering for the placement, and its fully parallel ``torch_dist`` save
  writing each shard once (:mod:`~megatron_prt.megatron.checkpoint_lm`);
* for a script that builds its model from a config (``pretrain_gpt.py`` from core_v0.19),
  ``config_or_provider(args, model_config, provider)``: the config without PRT, the wrapped
  provider with it.

and Megatron-LM calls :func:`validate_args` right before its own ``validate_args`` whenever
the flags are registered (``initialize.py`` at core_v0.16.1, ``arguments.py`` at
core_v0.19.0): without ``--pipeline-reuse`` it refuses the other ``--pipeline-reuse-*`` flags
and otherwise leaves Megatron's behaviour as is. ``--pipeline-reuse-timeout`` travels in the
:class:`ReuseConfig` to :func:`install`: it bounds every wait on a pipeline peer before a
``PipelineError`` names that peer.
"""

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Callable

from ..core.placement import ConfigError
from .args import add_arguments
from .args import validate_args as _validate_flags
from .config import ReuseConfig
from .plan_flag import is_first_launched, warn_other_vocabulary

__all__ = [
    "add_arguments",
    "add_arguments_and",
    "config_or_provider",
    "embedding_ranks_or",
    "get_embedding_ranks",
    "model_provider",
    "validate_args",
]


def validate_args(args: argparse.Namespace) -> ReuseConfig | None:
    """:func:`megatron_prt.megatron.args.validate_args` (refuse, translate), and under PRT let
    Megatron's checkpoints hold the result: ``save_checkpoint`` stores ``args``, which now
    carry ``pipeline_reuse_config``, and ``load_checkpoint`` reads them back with torch's
    ``weights_only`` loader, which refuses classes it was not told about. Rank 0 prints
    the layout in one line (:meth:`ReuseConfig.describe`), beside Megatron's own settings.

    An impossible combination of flags ends the process with exit status 2 after one line,
    ``megatron-prt: error: <the ConfigError's message>``, on rank 0's stderr (every rank
    sees the same flags, so every rank stops here, before any collective call)."""
    try:
        reuse = _validate_flags(args)
    except ConfigError as exc:  # the user's flags: one line naming them, not a traceback per rank
        from .bert_args import stop

        stop(str(exc).removeprefix("megatron-prt: "), status=2, prog="megatron-prt")
    if reuse is not None:
        if is_first_launched():
            print(f"megatron-prt: schedule {reuse.describe()}", flush=True)
        _allow_in_checkpoint_args()
    return reuse


def _allow_in_checkpoint_args() -> None:
    """Let torch's ``weights_only`` loader read the PRT values Megatron-LM's checkpoints
    keep in their args (``--pipeline-reuse auto[:R]`` is an :class:`AutoReuse`: it stopped
    every such resume). Done when this module is imported, as the patched scripts do first:
    ``--use-checkpoint-args`` reads a checkpoint's args before any validation runs."""
    import torch

    from ..core.placement import Placement
    from .args import AutoReuse

    torch.serialization.add_safe_globals([ReuseConfig, Placement, AutoReuse])


_allow_in_checkpoint_args()


def _reuse() -> ReuseConfig | None:
    from megatron.training import get_args

    return getattr(get_args(), "pipeline_reuse_config", None)


def get_embedding_ranks(pp_ranks: list[int], vp_size: int | None = None) -> list[int]:
    """Megatron's default embedding group, or only the first rank under PRT."""
    from megatron.core import parallel_state

    from .model import embedding_ranks

    if _reuse() is None:
        return parallel_state.default_embedding_ranks(pp_ranks)
    return embedding_ranks(pp_ranks, vp_size)


def embedding_ranks_or(script_ranks: Callable) -> Callable:
    """``get_embedding_ranks`` for a script that has its own (``pretrain_gpt.py``: the MTP
    ranks join the group): the script's without ``--pipeline-reuse``, :func:`get_embedding_ranks`
    with it."""

    @functools.wraps(script_ranks)
    def ranks(pp_ranks: list[int], *args, **kwargs) -> list[int]:
        if _reuse() is None:
            return script_ranks(pp_ranks, *args, **kwargs)
        return get_embedding_ranks(pp_ranks, *args, **kwargs)

    return ranks


def add_arguments_and(script_arguments: Callable | None) -> Callable:
    """``extra_args_provider`` that adds the ``--pipeline-reuse*`` flags, then the script's
    own (``None``: none, as ``pretrain_gpt.py`` passes without ModelOpt)."""

    def provider(parser):
        parser = add_arguments(parser)
        return parser if script_arguments is None else script_arguments(parser)

    return provider


def config_or_provider(
    args: argparse.Namespace, model_config, provider: Callable
) -> tuple[object | None, Callable | None]:
    """For a script that builds its model from a config (``pretrain_gpt.py`` from core_v0.19:
    ``pretrain(gpt_config_from_args(args) ...)``, the config's builder makes every chunk):
    ``(model_config, None)`` without ``--pipeline-reuse``, so Megatron builds as it would;
    with it ``(None, model_provider(provider))``, so ``pretrain`` builds the chunks through
    ``get_model`` and the wrapped ``provider`` (the builder has no per-chunk hook for the
    placement's roles and layout)."""
    if getattr(args, "pipeline_reuse_config", None) is None:
        return model_config, None
    return None, model_provider(provider)


def model_provider(provider: Callable) -> Callable:
    """Wrap Megatron-LM's ``model_provider(pre_process, post_process, vp_stage, config, ...)``
    for ``get_model``, which calls it once per chunk, chunk 0 first, on every rank."""
    built: list = []

    @functools.wraps(provider)
    def build(pre_process=True, post_process=True, vp_stage=None, config=None, **kwargs):
        reuse = _reuse()
        if reuse is None:
            return provider(pre_process, post_process, vp_stage=vp_stage, config=config, **kwargs)
        from megatron.training import get_args
        from megatron.training.arguments import core_transformer_config_from_args

        from . import checkpoint_lm
        from .installer import install
        from .layout import ReuseLayout
        from .model import model_provider as placed
        from .model import prepare_chunk

        args = get_args()
        if config is None:
            config = core_transformer_config_from_args(args)
        config.pipeline_model_parallel_layout = ReuseLayout(reuse)
        model = placed(provider, reuse)(vp_stage=vp_stage, config=config, **kwargs)
        if (vp_stage or 0) == 0:
            built.clear()  # a new model (e.g. a second get_model call)
            _warn_other_vocabulary(reuse, args)
        built.append(model)
        prepare_chunk(built, reuse)
        install(reuse, wrap=_glue_calls(reuse))
        checkpoint_lm.install()  # torch_dist saves: a rank may hold the tied embedding twice
        _answer_chunk_queries()
        return model

    return build


# [Note: Megatron-LM's checkpoints carry auto's pick] Megatron-LM's save_checkpoint stores
# ``args``: after every training call the glue sets ``args.pipeline_reuse_auto_pick`` to
# auto's final pick (:func:`~megatron_prt.megatron.auto.pick_record`, None before it is
# made), so a checkpoint saved after the final switch holds it. A resumed run
# (``args.iteration`` > 0 after Megatron-LM's load_checkpoint) reads the loaded
# checkpoint's arguments with megatron's own ``load_args_from_checkpoint`` before its first
# training call, and runs the pick from then on when it fits the run, profiling nothing ([Note:
# auto's pick is resumed] in :mod:`~megatron_prt.megatron.auto`); otherwise it profiles
# again, rank 0 saying why.
def _glue_calls(reuse: ReuseConfig) -> Callable[[Callable], Callable]:
    """``install``'s ``wrap``: before the first call (training or evaluation) a loaded
    torch-format checkpoint's layout is checked ([Note: torch-format checkpoints hold chunks
    by position]); under ``--pipeline-reuse auto`` the pick travels in the args (the note
    above)."""
    from megatron.training import get_args

    from .auto import pick_conditions, pick_record

    def wrap(forward_backward: Callable) -> Callable:
        state: dict = {"loaded": None, "resumed": False}
        record: dict = {"plan": None, "saved": None}  # auto's final plan, its record (JSON)

        @functools.wraps(forward_backward)
        def call(*positional, **keywords):
            args = get_args()
            if state["loaded"] is None:
                state["loaded"] = _check_loaded_layout(reuse, args)
            auto = reuse.auto_iterations
            if auto and not state["resumed"] and not keywords.get("forward_only"):
                state["resumed"] = True  # (an evaluation's m may differ)
                m = keywords.get("num_microbatches")
                _resume_auto_pick(forward_backward, reuse, args, m, state["loaded"])
            store = forward_backward(*positional, **keywords)
            if auto:
                final = forward_backward.auto.final
                if final is not record["plan"]:  # a plan's JSON is not free: once per pick
                    saved = pick_record(forward_backward, reuse, pick_conditions(args))
                    record.update(plan=final, saved=saved)
                args.pipeline_reuse_auto_pick = record["saved"]
            return store

        return call

    return wrap


def _saved_args(args: argparse.Namespace) -> argparse.Namespace:
    """The args of the checkpoint ``--load`` names (an empty namespace when there is none),
    read with megatron's own ``load_args_from_checkpoint`` on a copy, its lines silenced.
    Collective: megatron's ``read_metadata`` all-reduces the iteration (a read on rank 0
    alone hung the run), and with ``--ckpt-format torch`` each rank loads pipeline rank 0's
    whole file once to get them."""
    import contextlib
    import copy
    import io

    from megatron.training.checkpointing import load_args_from_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        loaded = load_args_from_checkpoint(copy.copy(args))
    return loaded[1] if isinstance(loaded, tuple) else argparse.Namespace()


# [Note: torch-format checkpoints hold chunks by position] Megatron-LM's torch format keys
# each rank's model chunks by position (``model0``, ``model1``, ...; layers by local
# number), and its load skips a chunk it does not find and loads the rest non-strictly;
# its own check compares only the tensor and pipeline sizes. A checkpoint saved under
# another PRT layout (or megatron's own, under R >= 2 or bi) loaded other layers into each
# chunk, or none, without a word (a loop R=3 checkpoint resumed as wave R=3 trained on at
# another loss). Before the first call, such a load is refused on every rank alike (all
# read the same saved args); torch_dist stores layers by their global number and resumes
# under any layout.
def _check_loaded_layout(reuse: ReuseConfig, args: argparse.Namespace) -> argparse.Namespace:
    """The loaded checkpoint's args (empty when nothing was read), after refusing a
    torch-format one saved under another layout (the note above). Reads them only where a
    torch-format load is possible (``--ckpt-format torch`` or auto-detection) and not from
    megatron's local non-persistent checkpoints (whose args megatron itself does not read)."""
    if (
        not getattr(args, "load", None)
        or getattr(args, "non_persistent_ckpt_type", None) == "local"
    ):
        return argparse.Namespace()
    could_be_torch = getattr(args, "ckpt_format", "torch") == "torch"
    if not could_be_torch and not getattr(args, "auto_detect_ckpt_format", False):
        return argparse.Namespace()
    saved = _saved_args(args)
    if getattr(saved, "ckpt_format", None) != "torch":
        return saved
    theirs = getattr(saved, "pipeline_reuse_config", None)
    if theirs is not None:
        same, how = _chunks_held(theirs) == _chunks_held(reuse), theirs.describe()
    else:
        same, how = _megatrons_layout_is(reuse, saved), "megatron's own pipeline layout"
    if not same:
        raise ConfigError(
            f"megatron-prt: --load {args.load} is a torch-format checkpoint saved under "
            f"{how}; this run is {reuse.describe()}. The torch format holds each rank's "
            "model chunks by position, so its layers would load into other layers, or not "
            "at all. Resume under the flags it was saved with, or convert it once under them "
            "(add --ckpt-convert-format torch_dist --ckpt-convert-save DIR) and load "
            "DIR/torch_dist with --ckpt-format torch_dist, which resumes under any layout"
        )
    return saved


def _chunks_held(reuse: ReuseConfig) -> tuple:
    """What a torch-format checkpoint's positions hold: each model stage's rank and chunk,
    the pipelines, and each stage's layer count (R = 1 loop and wave hold the same)."""
    placement = reuse.placement
    return (
        placement.stage_to_rank,
        placement.stage_to_chunk,
        placement.pipelines,
        reuse.layers_per_stage(),
    )


def _megatrons_layout_is(reuse: ReuseConfig, saved: argparse.Namespace) -> bool:
    """Whether a checkpoint of megatron's own schedule holds the chunks ``reuse`` runs:
    megatron's chunk c of rank r holds stage c * P + r (one chunk, or
    ``virtual_pipeline_model_parallel_size`` interleaved), over megatron's default even
    split (no uneven first / last stage, no layout, no embedding or loss counted in it)."""
    uneven = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
    accounted = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
    names = (*uneven, *accounted, "pipeline_model_parallel_layout")
    given = any(getattr(saved, name, None) for name in names)
    placement = reuse.placement
    chunks = getattr(saved, "virtual_pipeline_model_parallel_size", None) or 1
    ranks = placement.ranks
    stages = range(chunks * ranks)
    megatrons = (
        tuple(s % ranks for s in stages),
        tuple(s // ranks for s in stages),
        (tuple(stages),),
    )
    even = len(set(reuse.layers_per_stage())) == 1
    return _chunks_held(reuse)[:3] == megatrons and even and not given


_GRID_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")


def _resume_auto_pick(
    schedule: Callable,
    reuse: ReuseConfig,
    args: argparse.Namespace,
    m: int | None,
    loaded: argparse.Namespace,
) -> None:
    """Before a resumed run's first training call: the loaded checkpoint's pick, if any,
    from then on (``loaded``: its args when the layout check read them, else empty: read
    here, every rank alike, :func:`_saved_args`)."""
    if not getattr(args, "iteration", 0) or not getattr(args, "load", None) or args.finetune:
        return
    from .auto import pick_conditions, resume_pick

    saved = loaded if vars(loaded) else _saved_args(args)
    record = getattr(saved, "pipeline_reuse_auto_pick", None)
    same_grid = all(getattr(saved, name, None) == getattr(args, name) for name in _GRID_ARGS)
    where = f"{args.load} (iteration {args.iteration})"
    line = resume_pick(schedule, reuse, record, m, where, same_grid, pick_conditions(args))
    if is_first_launched():
        print(line, flush=True)


def _warn_other_vocabulary(reuse: ReuseConfig, args: argparse.Namespace) -> None:
    """The cost and plan files' vocabulary against the tokenizer's, which Megatron-LM has
    built (and padded, ``args.padded_vocab_size``) by the time it builds the model."""
    padded = getattr(args, "padded_vocab_size", None)
    if not reuse.recorded_vocab or padded is None:
        return
    training = importlib.import_module("megatron.training")
    try:  # a tool that set padded_vocab_size by hand may have built no tokenizer
        tokenizer = training.get_tokenizer()
    except (AttributeError, AssertionError):
        tokenizer = None
    warn_other_vocabulary(reuse.recorded_vocab, getattr(tokenizer, "vocab_size", padded), padded)


def _answer_chunk_queries() -> None:
    """Under PRT, ``is_pipeline_first_stage`` / ``is_pipeline_last_stage`` asked about chunk
    ``vp_stage`` (``ignore_virtual=False``) answer for the stage that chunk holds in the
    placement. Megatron-LM asks them per chunk outside any forward, e.g. ``pretrain_gpt.py``
    building a data iterator only for the chunks holding the first or last stage: under
    ``wave`` the last stage is chunk R-1 of rank 0, not the last chunk of rank P-1. Other
    questions go to the function in place (megatron's, or megatron-prt's answer for the
    running chunk)."""
    from megatron.core import parallel_state

    from .layout import chunk_roles

    for name, role_says in (
        ("is_pipeline_first_stage", lambda role: role.pre_process),
        ("is_pipeline_last_stage", lambda role: role.post_process),
    ):
        current = getattr(parallel_state, name)
        if getattr(current, "megatron_lm_chunks", False):
            continue

        def query(ignore_virtual=True, vp_stage=None, _current=current, _says=role_says):
            reuse = _reuse()
            if reuse is None or ignore_virtual or vp_stage is None:
                return _current(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
            rank = parallel_state.get_pipeline_model_parallel_rank()
            return _says(chunk_roles(reuse, rank)[vp_stage])

        query.megatron_lm_chunks = True  # type: ignore[attr-defined]
        setattr(parallel_state, name, query)
