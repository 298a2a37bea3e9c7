"""examples/bert_data.py: offline corpus -> WordPiece vocab -> indexed dataset -> BERT samples."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_prt.runtime.local import all_ok, run_local

EXAMPLE = Path(__file__).parents[1] / "examples" / "bert_data.py"
_spec = importlib.util.spec_from_file_location("bert_data", EXAMPLE)
bert_data = importlib.util.module_from_spec(_spec)
sys.modules["bert_data"] = bert_data  # dataclasses look their module up here
_spec.loader.exec_module(bert_data)

SEQ = 64
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


# ------------------------------------------------------------------- corpus and tokenizer


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


def test_basic_tokenize_follows_bert_rules():
    assert bert_data.basic_tokenize("Hello, World!") == ["hello", ",", "world", "!"]
    assert bert_data.basic_tokenize("Naïve Café\u00a0x") == ["naive", "cafe", "x"]
    assert bert_data.basic_tokenize("a\x00b\tc\u200bd 你好") == ["ab", "cd", "你", "好"]
    assert bert_data.basic_tokenize("don’t x²") == ["don", "’", "t", "x²"]


@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=60))
def test_ascii_fast_path_equals_general_path(text):
    general = []
    for word in bert_data._clean(text).split():
        general.extend(bert_data._split_punctuation(bert_data._strip_accents(word.lower())))
    assert bert_data.basic_tokenize(text) == general


def test_wordpiece_is_greedy_longest_match_first():
    vocab = {p: i for i, p in enumerate(["un", "##aff", "##able", "##a", "##ble"])}
    assert bert_data.wordpiece("unaffable", vocab) == ["un", "##aff", "##able"]
    assert bert_data.wordpiece("unable", vocab) == ["un", "##able"]
    # No backtracking, as in BERT: "una" matches first and "##ffable" then matches nothing.
    assert bert_data.wordpiece("unaffable", {**vocab, "una": 9}) == ["[UNK]"]
    assert bert_data.wordpiece("unx", vocab) == ["[UNK]"]
    assert bert_data.wordpiece("un" * 101, {"un": 0, "##un": 1}) == ["[UNK]"]


def test_vocab_training_is_deterministic_across_processes():
    """HF tokenizers' trainer is not (hash-ordered ties); ours must give one vocab."""
    code = (
        "import hashlib, sys; from collections import Counter; sys.path.insert(0, sys.argv[1]);"
        "import bert_data as b; c = Counter(w for d in b.default_corpus()"
        " for s in b.split_sentences(d) for w in b.basic_tokenize(s));"
        "print(hashlib.md5(' '.join(b.train_wordpiece_vocab(c, 1500)).encode()).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code, str(EXAMPLE.parent)],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (1, 2)
    }
    assert len(digests) == 1


def test_vocab_too_small_for_the_alphabet_is_refused():
    with pytest.raises(bert_data.DataError, match="too small"):
        bert_data.train_wordpiece_vocab({"abcdef": 3}, 12)


# ------------------------------------------------------------------- prepared default data


def test_default_corpus_prepares_deterministically(prepared, tmp_path):
    again = bert_data.prepare(tmp_path)
    for name in ("vocab.txt", "pydoc_text_sentence.bin", "pydoc_text_sentence.idx"):
        first = (Path(prepared.prefix).parent / name).read_bytes()
        assert first == (tmp_path / name).read_bytes(), name
    assert again.tokens == prepared.tokens > 100_000
    assert again.documents + again.dropped_documents == len(bert_data.default_corpus())


def test_vocab_holds_the_special_tokens(prepared):
    lines = Path(prepared.vocab_file).read_text(encoding="utf-8").splitlines()
    assert tuple(lines[:7]) == bert_data.SPECIAL_TOKENS
    assert len(lines) == len(set(lines)) == bert_data.DEFAULT_VOCAB_SIZE == prepared.vocab_size
    tokenizer = bert_data.WordPieceTokenizer(prepared.vocab_file)
    assert (tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask) == (0, 2, 3, 4)
    assert tokenizer.eod == tokenizer.eos == 6 and tokenizer.vocab_size == len(lines)
    assert tokenizer.detokenize(tokenizer.tokenize("Unaffable coroutines!")).replace(" ", "") == (
        "unaffablecoroutines!"
    )


def test_indexed_dataset_reads_back_tokens_and_sentence_boundaries(prepared):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prepared.prefix)
    tokenizer = bert_data.WordPieceTokenizer(prepared.vocab_file)
    bounds = dataset.document_indices
    assert prepared.dropped_documents == 0  # so document i of the corpus is document i here
    assert len(bounds) - 1 == prepared.documents and len(dataset) == prepared.sentences
    assert dataset[0].dtype == np.uint16
    for doc, text in enumerate(bert_data.default_corpus()):  # none dropped from pydoc
        sentences = [tokenizer.tokenize(s) for s in bert_data.split_sentences(text)]
        sentences = [s for s in sentences if s]
        items = [dataset[i] for i in range(bounds[doc], bounds[doc + 1])]
        assert np.concatenate(items).tolist() == [t for s in sentences for t in s]
        # Every sentence boundary is an item boundary; long sentences are cut further.
        assert set(np.cumsum([len(s) for s in sentences])) <= set(np.cumsum(list(map(len, items))))
        assert max(map(len, items)) <= bert_data.MAX_SENTENCE_TOKENS


# ----------------------------------------------------------------------- BERT datasets


def _build_and_sample(rank, world, prefix, vocab_file, num_samples, binary_head):
    tokenizer = bert_data.WordPieceTokenizer(vocab_file)
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
    assert 1 <= loss_mask.sum() <= 0.15 * SEQ + 1
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
    tokenizer = bert_data.WordPieceTokenizer(prepared.vocab_file)
    stream = Path(prepared.prefix + ".bin").read_bytes()
    epoch = bert_data.samples_per_epoch(prepared.prefix, SEQ, "80,10,10", 1234, binary_head)
    assert min(epoch) > 0
    for num_samples in [(None, None, None), (2 * epoch[0], 5, 5)]:
        ((lengths, samples),) = all_ok(
            run_local(
                1, _build_and_sample, prepared.prefix, prepared.vocab_file, num_samples, binary_head
            )
        )
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


def test_user_jsonl_corpus_through_the_cli(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    corpus = tmp_path / "reviews.jsonl"
    records = [{"id": i, "body": doc} for i, doc in enumerate(_user_documents(30))]
    records.append({"id": 99, "body": "A single sentence is dropped."})
    corpus.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    argv = ["prepare", "--out", tmp_path, "--input", corpus, "--json-key", "body"]
    assert bert_data.main([str(a) for a in [*argv, "--vocab-size", "200"]]) == 0
    assert "30 documents" in capsys.readouterr().err
    prefix = tmp_path / "reviews_body_sentence"
    assert (
        prefix.with_suffix(".idx").is_file()
        and len(bert_data.load_vocab(tmp_path / "vocab.txt")) <= 200
    )
    ((code, shown),) = all_ok(
        run_local(1, _show, ["show", "--out", str(tmp_path), "--seq-length", "32"])
    )
    assert code == 0 and "samples train" in shown and "[CLS]" in shown


def test_jsonl_lines_end_at_newline_only(tmp_path):
    corpus = tmp_path / "odd.jsonl"
    lines = [json.dumps({"text": "One.\u2028Two."}, ensure_ascii=False), '{"text": "Three."}']
    corpus.write_text("\n".join(lines), encoding="utf-8")
    assert bert_data.read_corpus(corpus) == ["One.\u2028Two.", "Three."]


def test_plain_text_corpus_and_an_existing_vocab(prepared, tmp_path):
    corpus = tmp_path / "book.txt"
    corpus.write_text("\n\n".join(_user_documents(10)) + "\n", encoding="utf-8")
    result = bert_data.prepare(tmp_path / "out", corpus, vocab_file=prepared.vocab_file)
    assert result.documents == 10 and result.prefix.endswith("book_text_sentence")
    again = bert_data.prepare(
        tmp_path / "out", corpus, json_key="body", vocab_file=result.vocab_file
    )
    assert again.prefix == result.prefix  # plain text has no key: "text" as preprocess_data.py
    digest = hashlib.md5(Path(result.vocab_file).read_bytes()).hexdigest()
    assert digest == hashlib.md5(Path(prepared.vocab_file).read_bytes()).hexdigest()


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


def test_a_split_megatron_cannot_build_is_refused(tmp_path):
    pytest.importorskip("megatron.core")
    corpus = tmp_path / "three.txt"
    corpus.write_text("\n\n".join(_user_documents(3)), encoding="utf-8")
    prefix = bert_data.prepare(tmp_path, corpus, vocab_size=200).prefix
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
    with pytest.raises(bert_data.DataError, match=r"train set .* makes no sample"):
        bert_data.samples_per_epoch(prefix, SEQ, "80,10,10")
    assert bert_data.samples_per_epoch(prefix, SEQ, "80,10,10", binary_head=False) == [8, 1, 1]


# ------------------------------------------------------------- damaged indexed datasets


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 30-document dataset (vocab of 200) that each test below copies and damages."""
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("small")
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(_user_documents(30)), encoding="utf-8")
    return bert_data.prepare(root / "data", corpus, vocab_size=200)


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
    ("bin too long", lambda p: Path(p + ".bin").write_bytes(b"\0" * 2000), "longer than its"),
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
    vocab = bert_data.WordPieceTokenizer(small.vocab_file).vocab_size
    bert_data.check_indexed_dataset(small.prefix, vocab)
    with pytest.raises(bert_data.DataError, match="token id"):
        bert_data.check_indexed_dataset(small.prefix, 10)
