"""A resume whose vocabulary is padded otherwise, or comes from another tokenizer (of
another size, or of the same size with other pieces or another type), is refused naming the
flag that fixes it ([Note: the vocabulary on resume] in
megatron_prt/megatron/bert_checkpoint.py): megatron-core loaded the embedding and output
layer with their rows cut or zero-filled and went on with another model, without a word."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_prt.megatron.bert_checkpoint import _other_model, model_shape


def _args(
    tp: int, divisor: int, tokens: int, digest: str = "ab12", kind: str = "BertWordPieceCase"
) -> argparse.Namespace:
    padded = -(-tokens // (divisor * tp)) * divisor * tp
    return argparse.Namespace(
        num_layers=4, hidden_size=32, ffn_hidden_size=None, num_attention_heads=4,
        max_position_embeddings=None, seq_length=32, bert_binary_head=True,
        tensor_model_parallel_size=tp, make_vocab_size_divisible_by=divisor,
        vocab_size=tokens, padded_vocab_size=padded, vocab_digest=digest, tokenizer_type=kind,
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


def test_a_tokenizer_of_the_same_size_with_other_pieces_or_splitting_is_refused():
    saved = _saved(_args(1, 128, 4096))
    problem = _other_model(_args(1, 128, 4096, digest="cd34"), saved, Path("ckpt"))
    assert "another vocabulary of the same 4096 tokens there" in problem
    assert "give the --vocab-file or --tokenizer-model it was saved with" in problem
    problem = _other_model(_args(1, 128, 4096, kind="BertWordPieceLowerCase"), saved, Path("c"))
    assert "--tokenizer-type BertWordPieceCase there, BertWordPieceLowerCase here" in problem


def test_the_digest_follows_the_pieces_not_the_file(tmp_path):
    """A copy of a tokenizer digests alike; one trained on other text to the same size (its
    ids stand for other pieces) does not."""
    pytest.importorskip("sentencepiece")
    from megatron_prt.megatron.tokenizer import load_tokenizer, train_tokenizer

    cats = "the cat sat on the mat while the other cat ran far away"
    dogs = "dogs bark loudly at night and wake every sleeping neighbour"
    texts = {"a": [cats] * 40 + [dogs] * 4, "b": [dogs] * 40 + [cats] * 4}  # the same letters
    for name, text in texts.items():
        assert train_tokenizer(text, tmp_path / f"{name}.model", 295) == 295
    shutil.copy(tmp_path / "a.model", tmp_path / "copy.model")
    a, copy, b = (load_tokenizer(tmp_path / f"{n}.model") for n in ("a", "copy", "b"))
    assert a.vocab_size == b.vocab_size == 295
    assert a.vocab_digest == copy.vocab_digest != b.vocab_digest


def test_no_divisor_at_this_tensor_parallel_size_says_so():
    saved = _saved(_args(1, 1, 4097))  # 4097 rows: odd, no multiple of 2 equals it
    problem = _other_model(_args(2, 1, 4097), saved, Path("ckpt"))
    assert "no --make-vocab-size-divisible-by gives 4097 at --tensor-model-parallel-size 2" in (
        problem
    )


def test_a_checkpoint_without_the_vocabulary_record_still_loads():
    saved = _saved(_args(1, 128, 4096))
    for key in ("vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by", "vocab_digest"):
        del saved["model"][key]
    assert _other_model(_args(2, 128, 4096), saved, Path("ckpt")) is None


def test_another_transformer_impl_or_precision_is_named():
    """Both change which tensors a checkpoint holds (TE's layer norms live in linear_qkv;
    --bf16 keeps fp32 main parameters in the optimizer): the refusal said another model or
    another optimizer, naming neither flag. A checkpoint without the record (saved before
    it) is left to its tensors."""
    ours = _args(1, 128, 4096)
    saved = _saved(argparse.Namespace(**vars(ours), transformer_impl="transformer_engine"))
    problem = _other_model(ours, saved, Path("ckpt"))
    assert "--transformer-impl transformer_engine there, local here" in problem
    saved = _saved(argparse.Namespace(**vars(ours), bf16=True))
    assert "precision --bf16 there, fp32 here" in _other_model(ours, saved, Path("ckpt"))
    older = _saved(ours)
    del older["model"]["transformer_impl"], older["model"]["precision"]
    assert _other_model(ours, older, Path("ckpt")) is None
