"""Chunks built by hand from megatron's own rules instead of the PRT layout are refused by
``prepare_model`` on every rank (they trained as another model: wave ran its layers out of
order, bi dropped half of them)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from megatron_models import build_model, setup_megatron, transformer_config

from megatron_prt.core import Placement
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.runtime.local import run_local


def _prepare(rank, world, direction, how, kind="gpt-untied"):
    from megatron_prt.megatron import prepare_model
    from megatron_prt.megatron.layout import chunk_roles
    from megatron_prt.megatron.model import transformer_config_kwargs

    reuse = ReuseConfig(Placement(2, 2, "wave", direction), 8)
    chunks = reuse.placement.chunks_per_rank
    setup_megatron(2, chunks)
    if how == "megatron-sizes":  # what a user sets without transformer_config_kwargs
        config = transformer_config(
            8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=chunks
        )
    elif how == "loop-layout":  # a PRT layout, of another placement: other layer numbers
        other = ReuseConfig(Placement(2, 2, "loop", direction), 8)
        config = transformer_config(**transformer_config_kwargs(other))
    else:
        config = transformer_config(**transformer_config_kwargs(reuse))
    model = []
    for c, role in enumerate(chunk_roles(reuse, rank)):
        if how == "megatron-roles":  # megatron's interleaved rule: first chunk of rank 0 ...
            pre, post = c == 0 and rank == 0, c == chunks - 1 and rank == world - 1
        else:
            pre, post = role.pre_process, role.post_process
        model.append(build_model(kind, config, pre, post, vp_stage=c))
    try:
        prepare_model(model, reuse)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "direction, how, said",
    [
        ("uni", "megatron-sizes", "was built without the PRT layer layout"),
        ("bi", "megatron-sizes", "was built without the PRT layer layout"),
        ("uni", "megatron-roles", "was built with post_process="),
        ("uni", "roles", None),
        ("bi", "roles", None),
        ("uni", "loop-layout", "], its stage computes layers ["),
    ],
)
@pytest.mark.parametrize("kind", ["gpt-untied", "bert"])  # BERT's layers are its encoder's
def test_chunks_built_as_another_model_are_refused(direction, how, said, kind):
    results = run_local(2, _prepare, direction, how, kind)
    for status, error in results:
        assert status == "ok", error
        if said is None:
            assert error is None
        else:  # a rank with a wrong chunk says how; one whose chunks are right names them
            assert said in error or "refused their chunk" in error, error
    assert said is None or any(said in error for _, error in results)
