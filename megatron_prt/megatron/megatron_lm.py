"""Glue for Megatron-LM's training scripts (``pretrain_bert.py``; see ``patches/``).

Megatron-LM builds its arguments inside ``pretrain()``, so this module is the one place in
megatron-prt that reads them through ``megatron.training.get_args()``; everything below it
takes a :class:`~megatron_prt.megatron.config.ReuseConfig`. A patched script passes:

* ``extra_args_provider=add_arguments`` (the ``--pipeline-reuse*`` flags);
* ``get_embedding_ranks=get_embedding_ranks`` (PRT sums tied embedding gradients itself);
* ``model_provider(provider)`` instead of ``provider``: chunk roles and the layer layout from
  the placement, replica/tied weights prepared as chunks are built, and PRT installed as the
  forward-backward function megatron's training loop looks up.

and ``megatron/training/initialize.py`` calls :func:`validate_args` right before Megatron's own
``validate_args``. Without ``--pipeline-reuse`` every hook leaves Megatron's behaviour as is.
``--pipeline-reuse-timeout`` travels in the :class:`ReuseConfig` to :func:`install`: it bounds
every wait on a pipeline peer before a ``PipelineError`` names that peer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from .args import add_arguments, validate_args
from .config import ReuseConfig

__all__ = ["add_arguments", "get_embedding_ranks", "model_provider", "validate_args"]


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

        from .installer import install
        from .layout import ReuseLayout
        from .model import model_provider as placed
        from .model import prepare_chunk

        if config is None:
            config = core_transformer_config_from_args(get_args())
        config.pipeline_model_parallel_layout = ReuseLayout(reuse)
        model = placed(provider, reuse)(vp_stage=vp_stage, config=config, **kwargs)
        if (vp_stage or 0) == 0:
            built.clear()  # a new model (e.g. a second get_model call)
        built.append(model)
        prepare_chunk(built, reuse)
        install(reuse)
        return model

    return build
