"""examples/bert_data.py: offline corpus -> SentencePiece tokenizer -> indexed dataset -> BERT
samples (the command line and ``prepare``; the pieces are tested in test_data_preprocess.py)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest

from megatron_prt.runtime.local import all_ok, run_local

EXAMPLE = Path(__file__).parents[2] / "examples" / "bert_data.py"
_spec = importlib.util.spec_from_file_location("bert_data", EXAMPLE)
bert_data = importlib.util.module_from_spec(_spec)
sys.modules["bert_data"] = bert_data  # dataclasses look their module up here
_spec.loader.exec_module(bert_data)

SEQ = 64
SMALL_VOCAB = 300  # the 7 special tokens, 256 byte pieces and a few dozen more
SENTENCES = [
    "The cat sat on the mat.",
    "It was warm there!",
    "Dogs bark at night?",
    "Birds sing in the morning.",
    "Fish swim in the river.",
]


def _user_documents(count: int) -> list[str]:
    """Small documents of 2..4 sentences, rotated so that they differ."""
    return [" ".join(SENTENCES[(i + k) % 5] for k in range(2 + i % 3)) for i in range(count)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The default corpus prepared once for the module (the tests only read it)."""
    pytest.importorskip("megatron.core")
    return bert_data.prepare(tmp_path_factory.mktemp("pydoc"))


# ------------------------------------------------------------------------------- corpus


def test_sentence_splitter_cuts_after_terminators_and_keeps_all_text():
    text = 'He said "Stop." Then (it ended.) See e.g. This one. 3 cats! Why? (Yes.)\n\nNew.  Two.'
    assert bert_data.split_sentences(text) == [
        'He said "Stop."',
        "Then (it ended.)",
        "See e.g. This one.",
        "3 cats!",
        "Why?",
        "(Yes.)",
        "New.",
        "Two.",
    ]
    assert bert_data.split_sentences("version 3.11 is here. and more") == [
        "version 3.11 is here. and more"
    ]
    assert bert_data.split_sentences(" \n\n \n") == []


# ------------------------------------------------------------------- prepared default data


def test_default_corpus_prepares_deterministically(prepared, tmp_path):
    again = bert_data.prepare(tmp_path)
    for name in ("tokenizer.model", "pydoc_text_sentence.bin", "pydoc_text_sentence.idx"):
        first = (Path(prepared.prefix).parent / name).read_bytes()
        assert first == (tmp_path / name).read_bytes(), name
    assert again.tokens == prepared.tokens > 100_000
    assert again.documents + again.dropped_documents == len(bert_data.default_corpus())


def test_the_tokenizer_holds_the_special_tokens(prepared):
    tokenizer = bert_data.load_tokenizer(prepared.tokenizer_file)
    assert prepared.vocab_file == prepared.tokenizer_file  # the name pretrain_bert.py reads
    assert tokenizer.vocab_size == bert_data.DEFAULT_VOCAB_SIZE == prepared.vocab_size
    assert [tokenizer.inv_vocab[i] for i in range(7)] == list(bert_data.SPECIAL_TOKENS)
    assert (tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask) == (0, 2, 3, 4)
    assert tokenizer.eod == 6
    text = "Unaffable coroutines!"
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_indexed_dataset_reads_back_the_sentences(prepared):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prepared.prefix)
    tokenizer = bert_data.load_tokenizer(prepared.tokenizer_file)
    bounds = dataset.document_indices
    assert prepared.dropped_documents == 0  # so document i of the corpus is document i here
    assert len(bounds) - 1 == prepared.documents and len(dataset) == prepared.sentences
    assert dataset[0].dtype == np.uint16
    for doc, text in enumerate(bert_data.default_corpus()):
        items = [dataset[i] for i in range(bounds[doc], bounds[doc + 1])]
        assert max(map(len, items)) <= bert_data.MAX_SENTENCE_TOKENS
        if len(items) == len(bert_data.split_sentences(text)):  # no sentence cut
            assert [tokenizer.detokenize(i) for i in items] == bert_data.split_sentences(text)
        else:  # a sentence over 512 tokens, cut before a word: the text is all there
            joined = " ".join(tokenizer.detokenize(i) for i in items)
            assert joined == " ".join(bert_data.split_sentences(text))


# ----------------------------------------------------------------------- BERT datasets


def _build_and_sample(rank, world, prefix, tokenizer_file, num_samples, binary_head):
    tokenizer = bert_data.load_tokenizer(tokenizer_file)
    datasets = bert_data.build_datasets(
        prefix, tokenizer, SEQ, "80,10,10", num_samples, 1234, binary_head
    )
    return [len(d) for d in datasets], [datasets[0][i] for i in range(8)]


def _check_sample(sample, tokenizer, stream: bytes, binary_head: bool) -> None:
    import numpy as np

    for key in ("text", "types", "labels", "loss_mask", "padding_mask"):
        assert sample[key].shape == (SEQ,) and sample[key].dtype == np.int64, key
    length = int(sample["padding_mask"].sum())
    assert sample["padding_mask"].tolist() == [1] * length + [0] * (SEQ - length)
    text, loss_mask, labels = sample["text"], sample["loss_mask"], sample["labels"]
    assert text[0] == tokenizer.cls and text[length - 1] == tokenizer.sep
    assert not text[length:].any() and not sample["types"][length:].any()
    assert loss_mask.sum() <= 0.15 * SEQ + 1
    # megatron masks min(0.15 x target length, ...) tokens, none when a short-sequence sample
    # draws a target under 7 tokens (its length is at most target + 3)
    assert loss_mask.sum() >= 1 or length < 10
    assert ((labels != -1) == (loss_mask == 1)).all()  # labels exactly at masked positions
    assert (loss_mask[text == tokenizer.mask] == 1).all()
    assert sample["is_random"] in (0, 1) and (binary_head or sample["is_random"] == 0)
    assert sample["types"].any() == binary_head  # segment B exists only with the binary head
    # Labels are the original tokens: with them put back, each segment (A, and B for the
    # binary head; both trimmed only at their ends) is a run of consecutive corpus tokens.
    original = np.where(loss_mask == 1, labels, text).astype(np.uint16)
    end_a = int((sample["types"][:length] == 0).sum())  # [CLS] A [SEP] | B [SEP]
    for segment in (original[1 : end_a - 1], original[end_a : length - 1]):
        assert _occurs(stream, segment.tobytes())


def _occurs(stream: bytes, run: bytes) -> bool:
    """Whether ``run`` is in ``stream`` at a token (2-byte) boundary."""
    offset = stream.find(run)
    while offset > 0 and offset % 2:
        offset = stream.find(run, offset + 1)
    return offset >= 0


@pytest.mark.parametrize("binary_head", [True, False])
def test_bert_datasets_build_on_cpu(prepared, binary_head):
    tokenizer = bert_data.load_tokenizer(prepared.tokenizer_file)
    stream = Path(prepared.prefix + ".bin").read_bytes()
    epoch = bert_data.samples_per_epoch(prepared.prefix, SEQ, "80,10,10", 1234, binary_head)
    assert min(epoch) > 0
    for num_samples in [(None, None, None), (2 * epoch[0], 5, 5)]:
        ((lengths, samples),) = all_ok(
            run_local(
                1, _build_and_sample, prepared.prefix, prepared.tokenizer_file, num_samples,
                binary_head,
            )
        )  # fmt: skip
        expected = [epoch[i] if n is None else n for i, n in enumerate(num_samples)]
        assert all(got >= want for got, want in zip(lengths, expected, strict=True))
        if num_samples[0] is None:
            assert lengths == epoch  # None is exactly one pass
        for sample in samples:
            _check_sample(sample, tokenizer, stream, binary_head)


def _show(rank, world, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = bert_data.main(argv)
    return code, out.getvalue()


def _write_jsonl(path: Path, count: int) -> None:
    records = [{"id": i, "body": doc} for i, doc in enumerate(_user_documents(count))]
    records.append({"id": 99, "body": "A single sentence is dropped."})
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")


def test_user_jsonl_corpus_through_the_cli(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    corpus = tmp_path / "reviews.jsonl"
    _write_jsonl(corpus, 30)
    argv = ["prepare", "--out", tmp_path, "--input", corpus, "--json-key", "body"]
    assert bert_data.main([str(a) for a in [*argv, "--vocab-size", str(SMALL_VOCAB)]]) == 0
    assert "30 documents" in capsys.readouterr().err
    prefix = tmp_path / "reviews_body_sentence"
    assert prefix.with_suffix(".idx").is_file()
    assert bert_data.load_tokenizer(tmp_path / "tokenizer.model").vocab_size <= SMALL_VOCAB
    ((code, shown),) = all_ok(
        run_local(1, _show, ["show", "--out", str(tmp_path), "--seq-length", "32"])
    )
    assert code == 0 and "samples train" in shown and "<CLS>" in shown


def test_a_vocabulary_smaller_than_asked_is_said(tmp_path, capsys):
    """Was: ``--vocab-size 8192`` on a small text wrote fewer pieces without a word."""
    pytest.importorskip("sentencepiece")
    corpus = tmp_path / "reviews.jsonl"
    _write_jsonl(corpus, 30)
    model = tmp_path / "spm.model"
    argv = ["train-tokenizer", "--tokenizer-model", str(model), "--input", str(corpus)]
    assert bert_data.main([*argv, "--json-key", "body", "--vocab-size", "8192"]) == 0
    size = bert_data.load_tokenizer(model).vocab_size
    assert size < 8192
    assert f"{size} pieces, fewer than the 8192 of --vocab-size" in capsys.readouterr().err


def test_train_tokenizer_then_preprocess_as_with_megatron_lm(tmp_path):
    """The README's steps: a tokenizer trained on the jsonl, then preprocess_data.py's flags;
    the result equals what ``prepare`` writes from the same jsonl."""
    pytest.importorskip("megatron.core")
    corpus = tmp_path / "reviews.jsonl"
    _write_jsonl(corpus, 30)
    model = tmp_path / "steps" / "spm.model"
    model.parent.mkdir()
    common = ["--input", str(corpus), "--json-key", "body", "--vocab-size", str(SMALL_VOCAB)]
    assert bert_data.main(["train-tokenizer", "--tokenizer-model", str(model), *common]) == 0
    code = bert_data.main(
        ["preprocess", "--input", str(corpus), "--json-keys", "body", "--output-prefix",
         str(tmp_path / "steps" / "reviews"), "--tokenizer-type", "SentencePieceTokenizer",
         "--tokenizer-model", str(model), "--split-sentences", "--min-sentences", "2"]
    )  # fmt: skip
    assert code == 0
    prepared = bert_data.prepare(tmp_path / "once", corpus, json_key="body", vocab_size=SMALL_VOCAB)
    assert model.read_bytes() == Path(prepared.tokenizer_file).read_bytes()
    for suffix in (".bin", ".idx"):
        steps = (tmp_path / "steps" / "reviews_body_sentence").with_suffix(suffix)
        assert steps.read_bytes() == Path(prepared.prefix + suffix).read_bytes()


def test_jsonl_lines_end_at_newline_only(tmp_path):
    corpus = tmp_path / "odd.jsonl"
    lines = [json.dumps({"text": "One.\u2028Two."}, ensure_ascii=False), '{"text": "Three."}']
    corpus.write_text("\n".join(lines), encoding="utf-8")
    assert bert_data.read_corpus(corpus) == ["One.\u2028Two.", "Three."]


def test_plain_text_corpus_and_an_existing_tokenizer(prepared, tmp_path):
    corpus = tmp_path / "book.txt"
    corpus.write_text("\n\n".join(_user_documents(10)) + "\n", encoding="utf-8")
    result = bert_data.prepare(tmp_path / "out", corpus, tokenizer_model=prepared.tokenizer_file)
    assert result.documents == 10 and result.prefix.endswith("book_text_sentence")
    again = bert_data.prepare(
        tmp_path / "out", corpus, json_key="body", tokenizer_model=result.tokenizer_file
    )
    assert again.prefix == result.prefix  # plain text has no key: "text" as preprocess_data.py
    given = Path(prepared.tokenizer_file).read_bytes()
    assert Path(result.tokenizer_file).read_bytes() == given


def test_a_wordpiece_vocab_prepares_through_megatron_core(tmp_path):
    """bert-base-uncased style vocab.txt users: megatron-core loads it with transformers."""
    pytest.importorskip("transformers")
    vocab = tmp_path / "vocab.txt"
    words = sorted({w.strip(".!?").lower() for s in SENTENCES for w in s.split()})
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "!", "?", *words]
    vocab.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    corpus = tmp_path / "book.txt"
    corpus.write_text("\n\n".join(_user_documents(10)), encoding="utf-8")
    result = bert_data.prepare(tmp_path / "out", corpus, vocab_file=vocab)
    tokenizer = bert_data.load_tokenizer(result.tokenizer_file)
    assert result.tokenizer_file.endswith("vocab.txt") and result.vocab_size == len(tokens)
    decoded = tokenizer.detokenize(tokenizer.tokenize(SENTENCES[0]))  # "the mat ." or "the mat."
    assert decoded.replace(" ", "") == SENTENCES[0].lower().replace(" ", "")
    assert tokenizer.word_start == [True] * len(tokens)  # no ## pieces in this vocab
    bert_data.check_indexed_dataset(result.prefix, tokenizer.vocab_size)


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("name", "content", "extra", "message"),
    [
        ("empty.jsonl", "", [], "holds no text"),
        ("blank.txt", "\n \n\n", [], "holds no text"),
        ("keys.jsonl", '{"body": "x"}\n', [], "no string under key 'text'"),
        ("broken.jsonl", "{not json\n", [], "not JSON"),
        ("short.txt", "One sentence only.\n\nAnother lone one.\n", [], "has 2 sentences"),
        ("small.txt", "Tiny. Corpus.\n", ["--vocab-size", "8"], "too small"),
        ("given.txt", "Tiny. Corpus.\n", ["--tokenizer-model", "nope.model"], "no such tokenizer"),
        ("missing.txt", None, [], "no such corpus file"),
        ("latin1.txt", "Café. Olé.".encode("latin-1"), [], "not UTF-8"),
    ],
)
def test_bad_input_fails_with_one_clear_line(tmp_path, capsys, name, content, extra, message):
    corpus = tmp_path / name
    if isinstance(content, bytes):
        corpus.write_bytes(content)
    elif content is not None:
        corpus.write_text(content, encoding="utf-8")
    code = bert_data.main(
        ["prepare", "--out", str(tmp_path / "out"), "--input", str(corpus), *extra]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and message in err[-1], err
    assert not any("Traceback" in line for line in err)
    written = sorted(p.name for p in (tmp_path / "out").glob("*"))
    assert written == [], f"a refused corpus left {written} behind"


def test_a_split_megatron_cannot_build_is_refused(tmp_path):
    pytest.importorskip("megatron.core")
    corpus = tmp_path / "three.txt"
    corpus.write_text("\n\n".join(_user_documents(3)), encoding="utf-8")
    prefix = bert_data.prepare(tmp_path, corpus, vocab_size=SMALL_VOCAB).prefix
    with pytest.raises(bert_data.DataError, match=r"valid set .* no document"):
        bert_data.samples_per_epoch(prefix, SEQ, "98,1,1")
    assert bert_data.samples_per_epoch(prefix, SEQ, "1,0,0")[1:] == [0, 0]
    with pytest.raises(bert_data.DataError, match="no room"):
        bert_data.samples_per_epoch(prefix, 4, "1,0,0")


def test_document_level_data_is_refused_for_the_binary_head(tmp_path):
    """preprocess_data.py without --split-sentences writes one item per document: megatron's
    mapping would spin forever looking for sentence pairs; we say so instead."""
    pytest.importorskip("megatron.core")
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "docs_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in range(10):
        builder.add_document(list(range(10, 30 + doc)), [20 + doc])
    builder.finalize(prefix + ".idx")
    with pytest.raises(bert_data.DataError, match=r"train set .* makes no sample") as refused:
        bert_data.samples_per_epoch(prefix, SEQ, "80,10,10")
    assert "preprocess the corpus with --split-sentences for BERT" in str(refused.value)
    assert bert_data.samples_per_epoch(prefix, SEQ, "80,10,10", binary_head=False) == [8, 1, 1]


# ------------------------------------------------------------- damaged indexed datasets


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 30-document dataset (small vocab) that each test below copies and damages."""
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("small")
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(_user_documents(30)), encoding="utf-8")
    return bert_data.prepare(root / "data", corpus, vocab_size=SMALL_VOCAB)


def _damaged(small, tmp_path, damage) -> str:
    """A copy of ``small``'s directory with ``damage(prefix)`` applied; returns the prefix."""
    import shutil

    out = tmp_path / "data"
    shutil.copytree(Path(small.prefix).parent, out)
    prefix = str(out / Path(small.prefix).name)
    damage(prefix)
    return prefix


def _cut(path: str, keep: int) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:keep])


def _append(path: str, extra: bytes) -> None:
    Path(path).write_bytes(Path(path).read_bytes() + extra)


def _put_token(prefix: str, token: int) -> None:
    import numpy as np

    with open(prefix + ".bin", "r+b") as f:
        f.write(np.array([token], dtype=np.uint16).tobytes())


def _shift_offsets(prefix: str) -> None:
    """Add 2 to the second sequence offset of the index (a flipped bit in a copy)."""
    import numpy as np

    data = bytearray(Path(prefix + ".idx").read_bytes())
    count = int(np.frombuffer(bytes(data[18:26]), dtype=np.uint64)[0])
    at = 34 + 4 * count + 8  # header, lengths, then pointer 1
    data[at : at + 8] = (int.from_bytes(data[at : at + 8], "little") + 2).to_bytes(8, "little")
    Path(prefix + ".idx").write_bytes(bytes(data))


DAMAGE = [
    ("truncated bin", lambda p: _cut(p + ".bin", -10), "the .bin is truncated"),
    ("empty bin", lambda p: _cut(p + ".bin", 0), ".bin holds 0 bytes but"),
    ("bin too long", lambda p: _append(p + ".bin", b"\0\0"), "longer than its"),
    ("missing bin", lambda p: os.remove(p + ".bin"), ".bin does not exist"),
    ("truncated idx", lambda p: _cut(p + ".idx", -7), ".idx is not a readable megatron index"),
    ("empty idx", lambda p: _cut(p + ".idx", 0), ".idx is not a readable megatron index"),
    ("bad idx header", lambda p: _cut(p + ".idx", 5), "bad header"),
    ("shifted offsets", _shift_offsets, "sequence offsets do not follow its lengths"),
]


@pytest.mark.parametrize("damage, message", [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_a_damaged_dataset_is_refused_naming_the_file(small, tmp_path, damage, message):
    """Megatron fails on these deep inside a run (``offset must be ... no greater than buffer
    length``, ``cannot mmap an empty file``) or, for a truncated .bin, only when it reaches
    the missing tokens; the sample count already refuses them."""
    prefix = _damaged(small, tmp_path, damage)
    with pytest.raises(bert_data.DataError, match=re.escape(message)) as caught:
        bert_data.samples_per_epoch(prefix, SEQ, "1,0,0")
    assert "bert_data.py prepare" in str(caught.value)


def test_token_ids_beyond_the_vocab_are_refused_through_the_cli(small, tmp_path):
    """Data tokenized with a larger vocab used to build and then fail in megatron's masking
    (``KeyError: np.uint16(61086)``) or in the printed sample."""
    prefix = _damaged(small, tmp_path, lambda p: _put_token(p, 61086))
    argv = ["show", "--out", str(Path(prefix).parent), "--seq-length", "32"]
    ((code, shown),) = all_ok(run_local(1, _show_with_errors, argv))
    assert code == 2 and shown.startswith("error: "), shown
    assert f"{prefix}.bin holds token id 61086, but the vocabulary has" in shown
    assert "Traceback" not in shown


def _show_with_errors(rank, world, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = bert_data.main(argv)
    return code, err.getvalue()


def test_an_intact_dataset_passes_the_check(small):
    vocab = bert_data.load_tokenizer(small.tokenizer_file).vocab_size
    bert_data.check_indexed_dataset(small.prefix, vocab)
    with pytest.raises(bert_data.DataError, match="token id"):
        bert_data.check_indexed_dataset(small.prefix, 10)


# ------------------------------------------------------------- data and tokenizer identity


def _sample_count(rank, world, prefix, tokenizer_file, cache_dir):
    tokenizer = bert_data.load_tokenizer(tokenizer_file)
    datasets = bert_data.build_datasets(
        prefix, tokenizer, SEQ, "80,10,10", (None, None, None), 1234, cache_dir=cache_dir
    )
    return len(datasets[0])


def test_data_rewritten_at_a_prefix_gets_its_own_sample_index(prepared, tmp_path):
    """megatron-core keys its sample-index cache by path, tokenizer, seed, split and count:
    a corpus rewritten at the same prefix (preprocess leaves a --data-cache-path alone) read
    the old index, samples across document ends (613 samples where 1267 are right)."""
    cache = str(tmp_path / "shared-cache")
    counts = []
    for documents in (12, 40):
        corpus = tmp_path / "book.txt"
        corpus.write_text("\n\n".join(_user_documents(documents)) + "\n", encoding="utf-8")
        out = bert_data.prepare(tmp_path / "out", corpus, tokenizer_model=prepared.tokenizer_file)
        fresh = bert_data.samples_per_epoch(out.prefix, SEQ, "80,10,10", 1234, True)[0]
        ((count,),) = [all_ok(run_local(1, _sample_count, out.prefix, out.tokenizer_file, cache))]
        counts.append((count, fresh))
    assert all(count == fresh for count, fresh in counts), counts
    assert counts[0][0] != counts[1][0]


def test_a_sentencepiece_model_trained_elsewhere_gets_megatron_lms_ids(tmp_path):
    """Megatron-LM's legacy SentencePieceTokenizer appends <CLS> <SEP> <EOD> <MASK>, then
    the model's own pad/bos/eos pieces; an order of our own gave eod 805 for 802."""
    import sentencepiece

    pytest.importorskip("megatron.core")
    from megatron_prt.megatron.tokenizer import check_bert_pad

    text = tmp_path / "text.txt"
    text.write_text("\n".join(_user_documents(200)), encoding="utf-8")
    prefix = str(tmp_path / "ext")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=prefix, vocab_size=30, num_threads=1, minloglevel=2
    )  # sentencepiece's defaults: unk 0, bos 1, eos 2, no pad piece
    tokenizer = bert_data.load_tokenizer(prefix + ".model")
    ids = (tokenizer.cls, tokenizer.sep, tokenizer.eod, tokenizer.mask, tokenizer.pad)
    assert ids == (30, 31, 32, 33, 34) and tokenizer.vocab_size == 35
    # megatron-core's BERT samples mark padding with the pad id: refused, not attended
    with pytest.raises(bert_data.DataError, match="its pad id is 34"):
        check_bert_pad(tokenizer)
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(_user_documents(4)), encoding="utf-8")
    with pytest.raises(bert_data.DataError, match="its pad id is 34"):  # before writing data
        bert_data.prepare(tmp_path / "out", corpus, tokenizer_model=prefix + ".model")
    assert not list((tmp_path / "out").glob("*.bin"))


def test_a_cased_vocab_prepares_cased(tmp_path, monkeypatch):
    """prepare read every vocab.txt as BertWordPieceLowerCase: --tokenizer-type
    BertWordPieceCase lower-cased the corpus while training read it cased."""
    from megatron_prt.megatron import data

    loaded = []

    def load(path, tokenizer_type=None):
        loaded.append(tokenizer_type)
        raise data.DataError("stop here")

    monkeypatch.setattr(data, "load_tokenizer", load)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nThe\n", encoding="utf-8")
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat. The cat sat.\n", encoding="utf-8")
    for given, expected in (
        ("BertWordPieceCase", "BertWordPieceCase"),
        (None, "BertWordPieceLowerCase"),
    ):
        with pytest.raises(data.DataError, match="stop here"):
            bert_data.prepare(tmp_path / "out", corpus, vocab_file=vocab, tokenizer_type=given)
        assert loaded.pop() == expected
    # a type without its file was ignored; one of another kind read the file as it is not
    for files, said in (
        ({}, "names the type of a given tokenizer file"),
        ({"tokenizer_model": vocab}, "BertWordPieceCase with --tokenizer-model: give one of"),
    ):
        with pytest.raises(data.DataError, match=said):
            bert_data.prepare(tmp_path / "o2", corpus, tokenizer_type="BertWordPieceCase", **files)
    assert not loaded


def test_the_data_digest_reads_the_whole_index_up_to_its_limit(tmp_path):
    """A rewrite that keeps both sizes and the index's ends (sentence lengths permuted in
    the middle) is told apart while the index is within the limit, not beyond it."""
    from megatron_prt.megatron.datasets import data_digest

    names = {}
    for name, middle in (("a", b"\x01\x02"), ("b", b"\x02\x01")):
        prefix = str(tmp_path / name)
        Path(prefix + ".bin").write_bytes(b"\x00" * 8)
        Path(prefix + ".idx").write_bytes(b"H" * 40 + middle + b"T" * 40)
        names[name] = (data_digest(prefix), data_digest(prefix, whole=64, edge=16))
    assert names["a"][0] != names["b"][0]  # the whole index: 82 bytes <= 64 MiB
    assert names["a"][1] == names["b"][1]  # beyond the limit: the ends alone
