"""A resume whose vocabulary is padded otherwise, or comes from another tokenizer, is
refused naming the flag that fixes it ([Note: the vocabulary on resume] in
megatron_prt/megatron/bert_checkpoint.py): megatron-core loaded the embedding and output
layer with their rows cut or zero-filled and went on with another model, without a word."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_prt.megatron.bert_checkpoint import _other_model, model_shape


def _args(tp: int, divisor: int, tokens: int) -> argparse.Namespace:
    padded = -(-tokens // (divisor * tp)) * divisor * tp
    return argparse.Namespace(
        num_layers=4, hidden_size=32, ffn_hidden_size=None, num_attention_heads=4,
        max_position_embeddings=None, seq_length=32, bert_binary_head=True,
        tensor_model_parallel_size=tp, make_vocab_size_divisible_by=divisor,
        vocab_size=tokens, padded_vocab_size=padded,
    )  # fmt: skip


def _saved(args: argparse.Namespace) -> dict:
    return {"model": model_shape(args), "layout": {"tensor_model_parallel_size": 1}}


def test_another_tensor_parallel_size_names_the_divisor_that_pads_alike():
    saved = _saved(_args(1, 128, 30522))  # bert-base's WordPiece: 30592 rows at TP 1
    problem = _other_model(_args(2, 128, 30522), saved, Path("ckpt"))  # 30720 at TP 2
    assert "vocabulary padded to 30592 rows there, 30720 here" in problem
    assert "give --make-vocab-size-divisible-by 64" in problem
    assert _other_model(_args(2, 64, 30522), saved, Path("ckpt")) is None  # the fix loads


def test_another_divisor_and_another_tokenizer_are_refused():
    saved = _saved(_args(1, 128, 4096))
    problem = _other_model(_args(1, 1000, 4096), saved, Path("ckpt"))
    assert "padded to 4096 rows there, 5000 here" in problem
    assert "give --make-vocab-size-divisible-by 128" in problem
    problem = _other_model(_args(1, 128, 4000), saved, Path("ckpt"))
    assert "a tokenizer of 4096 tokens there, 4000 here" in problem


def test_no_divisor_at_this_tensor_parallel_size_says_so():
    saved = _saved(_args(1, 1, 4097))  # 4097 rows: odd, no multiple of 2 equals it
    problem = _other_model(_args(2, 1, 4097), saved, Path("ckpt"))
    assert "no --make-vocab-size-divisible-by gives 4097 at --tensor-model-parallel-size 2" in (
        problem
    )


def test_a_checkpoint_without_the_vocabulary_record_still_loads():
    saved = _saved(_args(1, 128, 4096))
    for key in ("vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by"):
        del saved["model"][key]
    assert _other_model(_args(2, 128, 4096), saved, Path("ckpt")) is None
