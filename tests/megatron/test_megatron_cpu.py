"""megatron-core 0.16.1 models run on CPU through megatron_prt.megatron.cpu (one process,
gloo). Runs in a subprocess: the shim and megatron's parallel state are process-wide."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron_prt.megatron import cpu
    cpu.enable()
    cpu.enable()  # idempotent
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker, model_parallel_cuda_manual_seed)
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    parallel_state.initialize_model_parallel(1, 1)

    def config(dropout):
        return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
            use_cpu_initialization=True, hidden_dropout=dropout, attention_dropout=dropout)

    def gpt(seed, dropout=0.0):
        model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        return GPTModel(config=config(dropout), transformer_layer_spec=get_gpt_layer_local_spec(),
                        vocab_size=64, max_sequence_length=8)

    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    a, b = gpt(1), gpt(1)
    la, lb = a(tokens, pos, None, labels=tokens), b(tokens, pos, None, labels=tokens)
    assert torch.equal(la, lb), "same seed must build the same model"
    la.mean().backward()
    grads = [p.grad for p in a.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert not torch.equal(gpt(2)(tokens, pos, None, labels=tokens), la)

    # dropout inside tensor-parallel regions draws from the tracker's own CPU stream
    with get_cuda_rng_tracker().fork():
        first = torch.rand(3)
    with get_cuda_rng_tracker().fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)
    d = gpt(3, dropout=0.5)
    d.train()
    assert not torch.equal(d(tokens, pos, None, labels=tokens), d(tokens, pos, None, labels=tokens))

    model_parallel_cuda_manual_seed(4)
    bert = BertModel(config=config(0.0), num_tokentypes=2,
                     transformer_layer_spec=bert_layer_local_spec, vocab_size=64,
                     max_sequence_length=8)
    lm_loss, binary = bert(tokens, torch.ones(2, 8), tokentype_ids=torch.zeros_like(tokens),
                           lm_labels=tokens)
    (lm_loss.mean() + binary.mean()).backward()
    assert torch.isfinite(lm_loss).all() and lm_loss.shape == (2, 8)
    print("ok")
    """
)


def test_gpt_and_bert_forward_backward_on_cpu():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")


# Three runs of the same 3-step training of a small GPT: megatron's DDP + optimizer +
# no-pipelining schedule on 2 data-parallel ranks (2 micro-batches each) and on 1 rank (all 4),
# and plain torch (AdamW, clip_grad_norm_) on 1 rank. DP must match 1 rank (the DP all-reduce
# and the loss averaging); 1 rank must match plain torch (the grad norm, the clipping, Adam).
TRAIN_SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_prt.runtime.local import all_ok, run_local

    STEPS, MICRO, MBS, SEQ, VOCAB = 3, 4, 2, 8, 64
    LR, CLIP = 1e-3, 1.0
    # Adam divides by sqrt(v) + eps. The key bias has an exact zero gradient (softmax is
    # shift-invariant), so its update is fp32 rounding noise amplified by 1/eps; at the default
    # 1e-8 that noise moves it ~4e-7 differently per summation order, at 1e-6 ~2e-8. Every other
    # gradient is far above 1e-6, so eps does not change what the comparison checks.
    EPS = 1e-6
    # fp32 summation-order differences (micro-batch accumulation, DP averaging) measure <= 1e-7
    # relative on losses and norms and ~2e-8 absolute on parameters; a skipped clip moves
    # parameters by ~3e-4 and a skipped DP all-reduce by ~6e-3. atol is 1/1000 of one Adam step.
    TOL = dict(rtol=1e-5, atol=1e-6)


    def batches():
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, VOCAB, (STEPS, MICRO, MBS, SEQ + 1), generator=gen)


    def gpt():
        from megatron_prt.megatron import cpu
        cpu.enable()
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig
        parallel_state.initialize_model_parallel(1, 1)
        config = TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
            hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
            bias_activation_fusion=False, masked_softmax_fusion=False,
            bias_dropout_fusion=False, persist_layer_norm=False)
        model_parallel_cuda_manual_seed(1)
        torch.manual_seed(1)
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                        vocab_size=VOCAB, max_sequence_length=SEQ)


    def lm_loss(model, mb):
        tokens, labels = mb[:, :-1], mb[:, 1:]
        return model(tokens, torch.arange(SEQ).expand_as(tokens), None, labels=labels).mean()


    def params(model):
        return {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}


    def megatron_train(rank, world):
        model = gpt()
        from megatron.core.distributed import (
            DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            overlap_grad_reduce=False, use_distributed_optimizer=False), model)
        model.config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=LR, clip_grad=CLIP, weight_decay=0.0, adam_eps=EPS,
            log_num_zeros_in_grad=True), [ddp])

        def forward_step(data, model):
            # the schedule divides the loss in place: report a copy
            return lm_loss(model, next(data)), lambda out: (out, {"loss": out.detach().clone()})

        n = MICRO // world
        losses, norms = [], []
        for step in batches():
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            out = forward_backward_no_pipelining(
                forward_step_func=forward_step, data_iterator=iter(step[rank * n:(rank + 1) * n]),
                model=ddp, num_microbatches=n, seq_length=SEQ, micro_batch_size=MBS)
            ok, norm, zeros = optimizer.step()
            assert ok and zeros > 0, (ok, zeros)  # unseen vocabulary rows have zero grads
            losses.append([d["loss"].item() for d in out])
            norms.append(norm)
        return losses, norms, params(model)


    def torch_train(rank, world):
        model = gpt()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
        losses, norms = [], []
        for step in batches():
            optimizer.zero_grad()
            losses.append([])
            for mb in step:
                loss = lm_loss(model, mb)
                (loss / MICRO).backward()
                losses[-1].append(loss.item())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            optimizer.step()
        return losses, norms, params(model)


    def check(name, got, want):
        if isinstance(want, dict):
            assert got.keys() == want.keys(), name
            for key in want:
                check(f"{name} {key}", got[key], want[key])
            return
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                   torch.tensor(want, dtype=torch.float64), **TOL,
                                   msg=lambda m: f"{name}: {m}")


    (dp0, dp1), (one,), (ref,) = (all_ok(run_local(w, f)) for w, f in
                                  [(2, megatron_train), (1, megatron_train), (1, torch_train)])
    assert dp0[1] == dp1[1] and dp0[2] == dp1[2], "data-parallel replicas diverged"
    assert max(ref[1]) > CLIP, "clipping is not exercised"
    check("DP losses", [a + b for a, b in zip(dp0[0], dp1[0])], one[0])
    check("DP grad norms", dp0[1], one[1])
    check("DP parameters", dp0[2], one[2])
    check("losses vs torch", one[0], ref[0])
    check("grad norms vs torch", one[1], ref[1])
    check("parameters vs torch", one[2], ref[2])
    print("ok")
    """
)


def test_megatron_ddp_optimizer_and_schedule_train_on_cpu():
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")
