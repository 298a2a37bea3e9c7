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
