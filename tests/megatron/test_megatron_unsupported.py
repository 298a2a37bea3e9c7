"""megatron-core settings whose work only megatron's own schedules finish are refused by the
PRT forward-backward function, by name, before any micro-batch runs (each trained on
without a word: a weight with no gradient, weight gradients never computed, bi replicas
whose routers drift apart)."""

from __future__ import annotations

import pytest

from megatron_prt.core import Placement
from megatron_prt.core.placement import ConfigError
from megatron_prt.megatron.unsupported import UNSUPPORTED
from megatron_prt.runtime.local import all_ok, run_local

ON = {
    "defer_embedding_wgrad_compute": True,
    "delay_wgrad_compute": True,
    "overlap_moe_expert_parallel_comm": True,
    "num_microbatches_with_partial_activation_checkpoints": 1,
    "fine_grained_activation_offloading": True,
    "cuda_graph_impl": "local",
    "moe_router_enable_expert_bias": True,
    "moe_router_load_balancing_type": ["global_aux_loss"],
}


def _each_setting_on(rank, world, direction: str) -> dict[str, str]:
    """Per listed setting: the first call's outcome with that setting alone on (set on the
    model's config after building, as megatron's own checks would refuse some on CPU)."""
    import megatron_models as mm

    from megatron_prt.megatron import make_forward_backward_func, prepare_model
    from megatron_prt.megatron.config import ReuseConfig
    from megatron_prt.megatron.model import transformer_config_kwargs

    reuse = ReuseConfig(Placement(2, 1, "loop", direction), 2)
    mm.setup_megatron(2, reuse.placement.chunks_per_rank)
    config = mm.transformer_config(**transformer_config_kwargs(reuse))
    model = mm.model_chunks("gpt", config, reuse)
    prepare_model(model, reuse)
    forward_backward = make_forward_backward_func(reuse, timeout_s=60)
    outcome = {}
    for field, value in ON.items():
        before = getattr(config, field)
        setattr(config, field, value)
        try:
            forward_backward(**mm.step_kwargs("gpt", model, 4), forward_only=True)
            outcome[field] = "ran"
        except ConfigError as exc:
            outcome[field] = str(exc)
        finally:
            setattr(config, field, before)
    return outcome


@pytest.mark.parametrize("direction", ["uni", "bi"])
def test_settings_only_megatrons_schedules_finish_are_refused_by_name(direction):
    pytest.importorskip("megatron.core")
    assert set(ON) == set(UNSUPPORTED)
    for outcome in all_ok(run_local(2, _each_setting_on, direction)):
        for field, (_, bi_only, why) in UNSUPPORTED.items():
            if bi_only and direction == "uni":  # a router's state is its own pipeline's
                assert outcome[field] == "ran", field
                continue
            said = outcome[field]
            assert said.startswith(f"megatron-prt: {field}="), said
            assert said.endswith(why), said


def _with_another_p2p_group(rank, world) -> str:
    """The first call's outcome with a ``p2p_communicator`` on a group of this rank alone
    (megatron's schedules would send over it; the plan sends over the pipeline group)."""
    import megatron_models as mm
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_prt.megatron import make_forward_backward_func, prepare_model
    from megatron_prt.megatron.config import ReuseConfig
    from megatron_prt.megatron.model import transformer_config_kwargs

    reuse = ReuseConfig(Placement(2, 1), 2)
    mm.setup_megatron(2, reuse.placement.chunks_per_rank)
    config = mm.transformer_config(**transformer_config_kwargs(reuse))
    model = mm.model_chunks("gpt", config, reuse)
    prepare_model(model, reuse)
    alone = [dist.new_group([r]) for r in range(world)][rank]
    forward_backward = make_forward_backward_func(reuse, timeout_s=60)
    kwargs = mm.step_kwargs("gpt", model, 4)
    try:
        forward_backward(
            **kwargs, forward_only=True, p2p_communicator=P2PCommunicator(alone, config)
        )
        return "ran"
    except ConfigError as exc:
        return str(exc)


def test_a_p2p_communicator_on_another_group_is_refused():
    pytest.importorskip("megatron.core")
    for said in all_ok(run_local(2, _with_another_p2p_group)):
        assert said.startswith("megatron-prt: p2p_communicator's pipeline group"), said
        assert "ranks [0, 1]" in said, said


@pytest.mark.parametrize("group, said", [(None, None), (4, None), (2, "drop --microbatch-group")])
def test_megatrons_microbatch_grouping_is_refused_unless_its_default(group, said):
    """It orders megatron's interleaved schedule, which PRT replaces: taken and ignored."""
    from types import SimpleNamespace

    from megatron_prt.megatron.unsupported import refuse_unsupported

    config = SimpleNamespace(
        pipeline_model_parallel_size=4, microbatch_group_size_per_vp_stage=group
    )
    if said is None:
        refuse_unsupported(config, Placement(4, 2))
        return
    with pytest.raises(ConfigError, match=said):
        refuse_unsupported(config, Placement(4, 2))
