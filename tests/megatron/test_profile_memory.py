"""Measured activation memory and the megatron-core profiler.

* The saved-tensor meter counts exactly what autograd keeps (known sizes), each storage
  once, never parameters, and measuring does not change results.
* The activation peak each rank measures during a real pipelined step equals the
  simulator's prediction from per-layer costs measured the same way (plain PyTorch), and
  agrees with the prediction from ``profile_model`` for megatron-core GPT.
* ``profile_model`` returns the cost JSON (shape, sizes, sums) and the CLI writes it.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import pytest
import torch

from megatron_prt.core import Placement, build_plan
from megatron_prt.runtime import PipelineRuntime, build_stages
from megatron_prt.runtime.local import all_ok, run_local
from megatron_prt.runtime.memory import ActivationMeter, saved_activation_bytes
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate

H, B, LAYERS, M = 32, 4, 8, 4
F64 = 8  # bytes per float64 element
COST_KEYS = {"fwd", "bwd", "act", "param", "grad", "split_fwd", "split_bwd", "wgrad", "wact"}


def _mlp_layer(i: int) -> torch.nn.Module:
    # Saves, per micro-batch: its input (first Linear) and the ReLU output (ReLU and the
    # second Linear, one storage); its own output is saved by whoever consumes it.
    torch.manual_seed(i)
    layer = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.ReLU(), torch.nn.Linear(H, H))
    return layer.double()


def _data(m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(B, H, generator=g, dtype=torch.float64) for _ in range(m)]
    ys = [torch.randn(B, H, generator=g, dtype=torch.float64) for _ in range(m)]
    return xs, ys


# -- the meter ------------------------------------------------------------------------------
def test_saved_bytes_of_an_mlp_layer_are_exact():
    layer = _mlp_layer(0)
    x = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
    out, saved = saved_activation_bytes(lambda: layer(x), layer.parameters())
    assert saved == 2 * B * H * F64  # input + ReLU output; weights (saved as w.t()) excluded
    target = torch.zeros(B, H, dtype=torch.float64)
    _, loss_saved = saved_activation_bytes(lambda: torch.nn.functional.mse_loss(out, target))
    assert loss_saved == 2 * B * H * F64  # prediction and target
    # Without the parameter list the weights count: both (H, H) plus nothing else.
    _, with_weights = saved_activation_bytes(lambda: layer(x))
    assert with_weights == saved + 2 * H * H * F64


def test_views_share_one_storage_and_owners_release_it_together():
    meter = ActivationMeter()
    base = torch.zeros(4, 8, dtype=torch.float64)
    meter.hold("a", base[:2])  # a view counts its whole storage, once
    meter.hold("a", base.t())
    meter.hold("b", base[3])
    assert meter.held_bytes == base.nbytes
    meter.release("a")
    assert meter.held_bytes == base.nbytes  # "b" still holds it
    meter.hold("b", torch.ones(3))
    meter.release("b")
    assert meter.held_bytes == 0
    assert meter.peak_bytes == base.nbytes + 3 * 4


# -- a plain-PyTorch pipeline, measured and predicted ---------------------------------------
def _measure_mlp(rank, world, configs, measure: bool = True):
    out = {}
    xs, ys = _data(M)
    for reuse, placement in configs:
        plan = build_plan(Placement(world, reuse, placement, "uni"), M)
        stages = build_stages(plan.placement, rank, _mlp_layer, LAYERS)
        runtime = PipelineRuntime(
            plan, stages, torch.nn.functional.mse_loss, dtype=torch.float64, measure_memory=measure
        )
        losses = runtime.step(xs, ys)
        grads = [p.grad.clone() for s in sorted(stages) for p in stages[s].parameters()]
        stats = runtime.memory_stats() if measure else None
        out[(reuse, placement)] = (stats, losses, grads)
        runtime.close()
    return out


def _cost_model(layers: list[dict], embedding: dict | None, head: dict, stage_layers) -> CostModel:
    """Per-layer costs with the end-stage extras; folded into the first and last stage's
    layer lists where CostModel does not know ``embedding`` / ``head`` yet."""
    if "head" in CostModel.__dataclass_fields__:
        data = {"layers": layers, "head": head, "stage_layers": list(stage_layers)}
        if embedding is not None:
            data["embedding"] = embedding
        return CostModel.from_dict(data)
    counts = list(stage_layers)
    counts[-1] += 1
    if embedding is not None:
        layers, counts[0] = [embedding, *layers], counts[0] + 1
    entries = [LayerCost(**c) for c in [*layers, head]]
    return CostModel(layers=tuple(entries), stage_layers=tuple(counts))


def test_measured_activation_peak_equals_the_simulators():
    layer = _mlp_layer(0)
    x = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
    out, act = saved_activation_bytes(lambda: layer(x), layer.parameters())
    _, head_act = saved_activation_bytes(lambda: torch.nn.functional.mse_loss(out, x.detach()))
    layers = [{"fwd": 1.0, "bwd": 2.0, "act": act, "param": 0.0}] * LAYERS
    head = {"fwd": 0.0, "bwd": 0.0, "act": head_act, "param": 0.0}
    configs = [(2, "loop"), (2, "wave"), (1, "loop")]
    measured = all_ok(run_local(2, _measure_mlp, configs))
    plain = all_ok(run_local(2, _measure_mlp, configs, False))
    for config in configs:
        placement = Placement(2, config[0], config[1], "uni")
        per_stage = [LAYERS // placement.depth] * placement.depth
        cost = _cost_model(layers, None, head, per_stage)
        predicted = [
            r.peak_activation_bytes for r in simulate(build_plan(placement, M), cost).per_rank
        ]
        for rank in range(2):
            stats, losses, grads = measured[rank][config]
            _, plain_losses, plain_grads = plain[rank][config]
            assert stats["held_bytes"] == 0  # every backward released its forward's bytes
            assert losses == plain_losses and all(  # measuring changes nothing
                torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True)
            )
            peak, want = stats["peak_bytes"], predicted[rank]
            if config[1] == "loop":
                assert peak == want, (config, rank, peak, want)
            else:
                # wave: a same-rank hand-off's output is also saved by the producer's last
                # op (ReLU keeps its result) and so lives until the producer's backward;
                # the simulator frees it with the consumer. At most one message here.
                assert want <= peak <= want + B * H * F64, (config, rank, peak, want)
                assert peak <= 1.1 * want


def _measure_with_empty_stage(rank, world, stage_layers):
    xs, ys = _data(M)
    plan = build_plan(Placement(world, 2, "loop", "uni"), M)
    stages = build_stages(plan.placement, rank, _mlp_layer, sum(stage_layers), stage_layers)
    runtime = PipelineRuntime(
        plan, stages, torch.nn.functional.mse_loss, dtype=torch.float64, measure_memory=True
    )
    runtime.step(xs, ys)
    runtime.close()
    return runtime.memory_peak()


def test_an_empty_middle_stage_still_holds_its_input():
    """A stage without layers passes its input on but keeps it for backward: one message
    per micro-batch in flight, which the cost model counts (``stage_input_act``)."""
    layer = _mlp_layer(0)
    x = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
    out, act = saved_activation_bytes(lambda: layer(x), layer.parameters())
    _, head_act = saved_activation_bytes(lambda: torch.nn.functional.mse_loss(out, x.detach()))
    stage_layers = (2, 0, 1, 1)  # stage 1 (rank 1, chunk 0) is empty
    layers = [{"fwd": 1.0, "bwd": 2.0, "act": act, "param": 0.0}] * sum(stage_layers)
    head = {"fwd": 0.0, "bwd": 0.0, "act": head_act, "param": 0.0}
    cost = CostModel.from_dict(
        {"layers": layers, "head": head, "stage_layers": list(stage_layers),
         "message_bytes": B * H * F64}
    )  # fmt: skip
    predicted = simulate(build_plan(Placement(2, 2), M), cost).per_rank
    measured = all_ok(run_local(2, _measure_with_empty_stage, stage_layers))
    for rank in range(2):
        assert measured[rank] == predicted[rank].peak_activation_bytes, rank


# -- megatron-core: profile, then measure a pipelined step ----------------------------------
def _profile(rank, world, kind, num_layers, dtype, reps=1):
    from megatron_models import HIDDEN, MBS, SEQ, VOCAB

    from megatron_prt.megatron.profile import profile_model

    return profile_model(kind, num_layers, HIDDEN, 4, SEQ, MBS, VOCAB, dtype=dtype, reps=reps)


def test_profile_model_gives_the_cost_json():
    pytest.importorskip("megatron.core")
    from megatron_models import HIDDEN, MBS, SEQ, VOCAB

    costs = all_ok(run_local(1, _profile, "gpt", 3, "float32", 2))[0]
    assert set(costs) == {
        "layers",
        "embedding",
        "head",
        "message_bytes",
        "fwd_time",
        "bwd_time",
        "activation_bytes",
        "param_bytes",
        "grad_bytes",
        "tied_grad_bytes",
        "model",
        "stage",
    }
    assert costs["model"] == {  # what the costs hold for: sim/model_shape.py
        "model": "gpt",
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "ffn_hidden_size": 4 * HIDDEN,
        "seq_length": SEQ,
        "micro_batch_size": MBS,
        "vocab_size": VOCAB,
        "dtype": "float32",
        "transformer_impl": "local",
        "tensor_model_parallel_size": 1,
        "device": "cpu",
        "swiglu": False,
        "num_query_groups": 4,
        "untie_embeddings_and_output_weights": False,
        "hidden_dropout": 0.0,  # profile_model's default (the command line's: megatron's 0.1)
        "attention_dropout": 0.0,
    }
    parts = [*costs["layers"], costs["embedding"], costs["head"]]
    assert len(costs["layers"]) == 3
    assert all(set(p) == COST_KEYS for p in parts)
    assert all(p["act"] > 0 and p["param"] > 0 for p in parts)
    # [Note: every stage pays its step's work]: timed on a middle chunk, time only, taken
    # out of the embedding's forward and the head's backward (which may come to 0 then)
    stage, embedding, head = costs["stage"], costs["embedding"], costs["head"]
    assert stage["fwd"] + stage["bwd"] > 0 and stage["act"] == stage["param"] == 0
    assert stage["wgrad"] == 0  # all of it before W
    assert all(layer["fwd"] > 0 and layer["bwd"] > 0 for layer in costs["layers"])
    assert embedding["bwd"] > 0 and head["fwd"] > 0  # nothing taken out of these
    assert embedding["fwd"] >= 0 and head["bwd"] >= 0
    assert embedding["fwd"] + stage["fwd"] > 0 and head["bwd"] + stage["bwd"] > 0
    assert all(p["split_fwd"] > 0 for p in (*costs["layers"], head))
    assert all(p["split_fwd"] >= 0 and p["split_bwd"] >= p["wgrad"] >= 0 for p in parts)
    assert all(layer["wgrad"] > 0 for layer in costs["layers"])  # four linear layers each
    s, b, h, a, f32 = SEQ, MBS, HIDDEN, 4, 4
    # A local-spec GPT layer saves, in elements: its input, LN out, fused QKV (3), context,
    # attention + residual, LN2 out, fc1 out (4), GeLU out (4) = 16 sbh; the two layer
    # norms' mean and rstd = 4 sb; the softmax probabilities a b s^2 (no dropout masks).
    assert all(
        layer["act"] == (16 * s * b * h + 4 * s * b + a * b * s * s) * f32
        for layer in costs["layers"]
    )
    # 12 h^2 + 13 h parameters per layer, 16 bytes each (fp32 param, grad, two Adam moments)
    assert all(layer["param"] == (12 * h * h + 13 * h) * 16 for layer in costs["layers"])
    assert costs["embedding"]["param"] == (VOCAB + SEQ) * h * 16
    assert all(p["grad"] * 16 == p["param"] * 4 for p in parts)  # fp32 grads: 4 of the 16
    assert costs["head"]["param"] == (2 * h + VOCAB * h) * 16  # final LN + tied output copy
    assert costs["embedding"]["act"] == b * s * 8 + s * 8  # int64 token and position ids
    assert costs["message_bytes"] == s * b * h * f32
    assert costs["tied_grad_bytes"] == VOCAB * h * f32  # the output weight's copy, summed
    for total, key in (
        ("fwd_time", "fwd"),
        ("bwd_time", "bwd"),
        ("activation_bytes", "act"),
        ("param_bytes", "param"),
        ("grad_bytes", "grad"),
    ):
        assert costs[total] == pytest.approx(sum(p[key] for p in (*parts, stage)))
    assert json.loads(json.dumps(costs)) == costs
    if "head" not in CostModel.__dataclass_fields__:
        pytest.skip("CostModel does not read embedding/head yet")
    model = CostModel.from_dict(costs)
    assert model.head == LayerCost(**costs["head"])
    assert model.stage == LayerCost(**costs["stage"])
    assert len(model.layers) == 3


def test_profile_bert_counts_its_heads():
    pytest.importorskip("megatron.core")
    gpt, bert = (all_ok(run_local(1, _profile, k, 2, "float32"))[0] for k in ("gpt", "bert"))
    # BERT's head adds the LM head transform, pooler and binary head to GPT's
    assert bert["head"]["param"] > gpt["head"]["param"]
    assert bert["head"]["act"] > gpt["head"]["act"]
    assert bert["embedding"]["param"] > gpt["embedding"]["param"]  # token types
    assert bert["tied_grad_bytes"] == gpt["tied_grad_bytes"] > 0  # one vocab x hidden weight


def _measure_megatron(rank, world, reuse, m, kind="prt"):
    """One iteration of megatron-core GPT (float64) with activation memory measured, under
    ``kind``'s plan (:func:`_megatron_plan`)."""
    import megatron_models as mm

    from megatron_prt.megatron import prepare_model
    from megatron_prt.megatron.chunk_data import ChunkData
    from megatron_prt.megatron.model import transformer_config_kwargs
    from megatron_prt.megatron.schedule import MegatronPipeline

    placement = reuse.placement
    mm.setup_megatron(placement.ranks, placement.chunks_per_rank)
    # Megatron-LM frees sent outputs (deallocate_pipeline_outputs); TransformerConfig's
    # default keeps them until their backward, one message per in-flight stage more.
    config = mm.transformer_config(
        deallocate_pipeline_outputs=True, **transformer_config_kwargs(reuse)
    )
    model = mm.model_chunks("gpt", config, reuse)
    prepare_model(model, reuse)
    pipeline = MegatronPipeline(_megatron_plan(placement, m, kind), model, config, None, "cpu", 60)
    pipeline.measure_memory = True
    data = [ChunkData(iter(mm.batches(m)), c) for c in range(len(model))]
    pipeline.run(partial(mm.forward_step, "gpt", False), data, False, False, None)
    stats = pipeline.memory_stats()
    pipeline.close()
    return stats


def _megatron_plan(placement: Placement, m: int, kind: str):
    """``prt``: the plain plan; ``late-w``: its split form with every W at the end of its
    rank's order (each I's W work held until then)."""
    from megatron_prt.runtime.split_plan import split_backward_plan

    plan = build_plan(placement, m)
    return split_backward_plan(plan, None) if kind == "late-w" else plan


@pytest.mark.parametrize("placement", ["wave", "loop"])
def test_megatron_measured_peak_matches_the_profile(placement):
    pytest.importorskip("megatron.core")
    from megatron_prt.megatron.config import ReuseConfig

    layers, m = 4, 4
    reuse = ReuseConfig(Placement(2, 2, placement, "uni"), layers)
    costs = all_ok(run_local(1, _profile, "gpt", layers, "float64"))[0]
    cost = _cost_model(costs["layers"], costs["embedding"], costs["head"], reuse.layers_per_stage())
    sim = simulate(build_plan(reuse.placement, m), cost)
    measured = all_ok(run_local(2, _measure_megatron, reuse, m))
    mask = 8 * 8  # megatron's cached causal mask (seq^2 bools): a cache, held once per rank
    for rank, stats in enumerate(measured):
        peak, want = stats["peak_bytes"], sim.per_rank[rank].peak_activation_bytes
        assert stats["held_bytes"] == 0
        # Measured = predicted + the mask, + one message on a rank with a same-rank
        # hand-off (wave turn: see test_measured_activation_peak_equals_the_simulators).
        extra = peak - want
        assert extra in (mask, mask + costs["message_bytes"]), (rank, peak, want)
        assert abs(extra) <= 0.1 * want


# -- the CLI --------------------------------------------------------------------------------
def _cli(argv: list[str]) -> tuple[int, argparse.Namespace]:
    from megatron_prt.cli import profile

    parser = argparse.ArgumentParser(prog="megatron-prt")
    profile.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args), args


def _cli_worker(rank, world, argv):
    code, args = _cli(argv)
    with open(args.out) as f:
        return code, json.load(f)


def test_cli_profile_writes_the_cost_json(tmp_path):
    pytest.importorskip("megatron.core")
    out = tmp_path / "costs.json"
    argv = ["profile", "--model", "bert", "--num-layers", "3", "--hidden-size", "16"]
    argv += ["--num-attention-heads", "4", "--seq-length", "8", "--micro-batch-size", "2"]
    argv += ["--vocab-size", "64", "--reps", "1", "--profile-layers", "2", "-o", str(out)]
    argv += ["--comm", "none"]  # a daemonic rank cannot start the 2 timing ranks
    code, costs = all_ok(run_local(1, _cli_worker, argv))[0]
    assert code == 0
    assert len(costs["layers"]) == 3
    assert costs["layers"][2] == costs["layers"][1]  # profiled 2, the last one repeated
    assert costs["model"]["model"] == "bert" and costs["model"]["seq_length"] == 8


def test_cli_profile_prices_and_records_the_runs_dropout(tmp_path):
    """The profile ran without dropout whatever the run used (megatron's default 0.1): a
    layer's activation bytes came out without the masks dropout keeps (a balanced split
    accepted under a budget measured 23% over it), and no run was warned. Now the flags set
    it (default 0.1, as megatron's), the file records it, and a run under another is warned."""
    pytest.importorskip("megatron.core")
    from megatron_prt.megatron.plan_flag import running_shape
    from megatron_prt.sim.model_shape import shape_differences

    argv = ["profile", "--model", "gpt", "--num-layers", "1", "--hidden-size", "16"]
    argv += ["--num-attention-heads", "4", "--seq-length", "8", "--micro-batch-size", "2"]
    argv += ["--vocab-size", "64", "--reps", "1", "--comm", "none", "--no-split-backward"]
    acts, shapes = [], []
    for dropout in (None, "0"):
        out = tmp_path / f"costs-{dropout}.json"
        chosen = (
            [] if dropout is None else ["--hidden-dropout", dropout, "--attention-dropout", dropout]
        )
        code, costs = all_ok(run_local(1, _cli_worker, [*argv, *chosen, "-o", str(out)]))[0]
        assert code == 0
        acts.append(costs["layers"][0]["act"])
        shapes.append(costs["model"])
    assert acts[0] > acts[1]  # the masks dropout keeps
    assert (shapes[0]["hidden_dropout"], shapes[1]["attention_dropout"]) == (0.1, 0.0)
    training = argparse.Namespace(hidden_size=16, hidden_dropout=0.1, attention_dropout=0.1)
    assert shape_differences(shapes[1], running_shape(training)) == [
        "hidden_dropout 0.0 -> 0.1",
        "attention_dropout 0.0 -> 0.1",
    ]


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--num-layers", "0", "argument --num-layers: must be an integer >= 1"),  # argparse
        ("--hidden-size", "18", "--hidden-size 18 is not divisible by --num-attention-heads 4"),
    ],
)
def test_cli_profile_errors_are_one_line_exit_2(capsys, flag, value, message):
    from megatron_prt.cli import main

    if flag == "--hidden-size":
        pytest.importorskip("megatron.core")
    argv = ["profile", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "4"]
    argv += ["--seq-length", "8", "--micro-batch-size", "2", "--vocab-size", "64", flag, value]
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err


def _split_attribution(rank, world):
    """Each part's W, as ``time_passes(..., split=True)`` applies it: the parameter names of the
    weights in every ``apply_weight_grads`` call, in call order with the part timed."""

    from megatron_models import HIDDEN, MBS, SEQ, VOCAB

    from megatron_prt.megatron import profile, profile_passes
    from megatron_prt.megatron.pretrain import build_model
    from megatron_prt.megatron.split import enable_megatron_split_backward

    with profile._single_rank("cpu", 1234):
        config = profile._config_factory(torch.float32, 2, HIDDEN, None, 4, "cpu")()
        model = build_model("gpt", config, VOCAB, SEQ)
        enable_megatron_split_backward([model])
        names = {id(p): n for n, p in model.named_parameters()}
        step = partial(profile._forward_step, "gpt", config, model, (SEQ, MBS, VOCAB), "cpu")
        parts = profile_passes.Parts(model, "gpt")
        calls = []
        apply = profile_passes.apply_weight_grads
        profile_passes.apply_weight_grads = lambda works: calls.append(
            sorted(names[id(w.weight)] for w in works)
        )
        try:
            profile_passes.time_passes(step, parts, 1, lambda message: None, split=True)
        finally:
            profile_passes.apply_weight_grads = apply
            parts.remove()
    return calls[-4:]  # the timed pass: head, layer 1, layer 0, embedding


def test_split_profile_gives_each_part_its_own_weight_gradients():
    """W is timed per part from the work its backward deferred: the tied output weight is
    the head's, each layer's four linear layers are its own, the embedding has none."""
    pytest.importorskip("megatron.core")
    head, layer1, layer0, embedding = all_ok(run_local(1, _split_attribution))[0]
    assert head == ["embedding.word_embeddings.weight"]  # the output layer's tied weight
    for index, layer in ((1, layer1), (0, layer0)):
        prefix = f"decoder.layers.{index}."
        assert len(layer) == 4 and all(name.startswith(prefix) for name in layer), layer
    assert embedding == []


def test_megatron_split_backward_peak_matches_the_profiled_wact():
    """The profile's ``wact`` (what each part's deferred W keeps from I until W) prices a
    split plan's peak as the meter measures it in megatron-core GPT: every W at the end, so
    each rank holds every micro-batch's W operands at once. Without ``wact`` the simulator
    took 32/34 of ``act``: 3.6% high here)."""
    pytest.importorskip("megatron.core")
    from megatron_prt.megatron.config import ReuseConfig

    layers, m = 4, 4
    reuse = ReuseConfig(Placement(2, 2, "loop", "uni"), layers)
    costs = all_ok(run_local(1, _profile, "gpt", layers, "float64"))[0]
    cost = _cost_model(costs["layers"], costs["embedding"], costs["head"], reuse.layers_per_stage())
    sim = simulate(_megatron_plan(reuse.placement, m, "late-w"), cost)
    measured = all_ok(run_local(2, _measure_megatron, reuse, m, "late-w"))
    mask = 8 * 8  # megatron's cached causal mask, as above
    for rank, stats in enumerate(measured):
        assert stats["held_bytes"] == 0
        assert stats["peak_bytes"] - mask == sim.per_rank[rank].peak_activation_bytes, rank
