"""The data path's pieces: a SentencePiece tokenizer trained on a few KB of text, loaded by
megatron-core's tokenizers; preprocess (Megatron-LM's tools/preprocess_data.py) of a jsonl into
megatron's indexed datasets, read back with megatron-core's IndexedDataset and decoded to the
original text; megatron-core's BERT and GPT datasets built from them."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
np = pytest.importorskip("numpy")

from megatron_prt.megatron import data  # noqa: E402
from megatron_prt.megatron import preprocess as preprocess_tool  # noqa: E402
from megatron_prt.runtime.local import all_ok, run_local  # noqa: E402

SEQ = 48
VOCAB = 600


def _documents() -> list[str]:
    """About 20 KB of English in documents of several sentences each (CPython's help topics)."""
    return [doc for doc in data.default_corpus()[:12] if len(data.split_sentences(doc)) >= 2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A jsonl of the documents (keys ``text`` and ``title``) and a SentencePiece model."""
    root = tmp_path_factory.mktemp("spm")
    documents = _documents()
    jsonl = root / "topics.jsonl"
    records = [{"title": f"Topic number {i}.", "text": doc} for i, doc in enumerate(documents)]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    model = root / "spm.model"
    sentences = [s for doc in documents for s in data.split_sentences(doc)]
    assert data.train_tokenizer(sentences, model, VOCAB) == VOCAB
    return jsonl, model, documents


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return data.load_tokenizer(corpus[1])


def _preprocess(corpus, out: Path, *flags: str) -> list:
    jsonl, model, _ = corpus
    parser = _parser()
    args = parser.parse_args(
        ["--input", str(jsonl), "--output-prefix", str(out), "--tokenizer-type",
         "SentencePieceTokenizer", "--tokenizer-model", str(model), *flags]
    )  # fmt: skip
    return preprocess_tool.run(args)


def _parser():
    import argparse

    parser = argparse.ArgumentParser()
    preprocess_tool.add_arguments(parser)
    return parser


def test_the_tokenizer_is_megatron_cores_with_bert_and_gpt_special_ids(corpus, tokenizer):
    import sentencepiece

    assert type(tokenizer.megatron).__module__.startswith("megatron.core.tokenizers")
    assert tokenizer.vocab_size == VOCAB == len(tokenizer.inv_vocab)
    ids = (tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.eod)
    assert ids == (0, 2, 3, 4, 6)
    assert [tokenizer.inv_vocab[i] for i in range(7)] == list(data.SPECIAL_TOKENS)
    # Megatron-LM's SentencePieceTokenizer finds the same ids under its names, adding none.
    model = sentencepiece.SentencePieceProcessor(model_file=str(corpus[1]))
    names = ["<CLS>", "<SEP>", "<MASK>", "<EOD>"]
    assert [model.piece_to_id(n) for n in names] == [2, 3, 4, 6]
    assert (model.pad_id(), model.bos_id(), model.eos_id(), model.get_piece_size()) == (
        0, 5, 6, VOCAB
    )  # fmt: skip
    # Control symbols: text never encodes to them (byte fallback: nor to <UNK>).
    text = "CLS SEP MASK:\tnaïve  café,\n你好 — ok?"
    encoded = tokenizer.tokenize(text)
    assert not set(encoded) & set(range(7))
    assert tokenizer.detokenize(encoded) == text


def test_training_is_deterministic_and_refuses_a_tiny_vocab(corpus, tmp_path):
    sentences = [s for doc in corpus[2] for s in data.split_sentences(doc)]
    data.train_tokenizer(sentences, tmp_path / "again.model", VOCAB)
    assert (tmp_path / "again.model").read_bytes() == Path(corpus[1]).read_bytes()
    with pytest.raises(data.DataError, match="too small"):
        data.train_tokenizer(sentences, tmp_path / "tiny.model", 100)
    with pytest.raises(data.DataError, match="not a SentencePiece model"):
        data.load_tokenizer(corpus[0], "SentencePieceTokenizer")


def test_sentence_level_data_reads_back_as_the_original_sentences(corpus, tokenizer, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    written = _preprocess(corpus, tmp_path / "topics", "--json-keys", "text", "title",
                          "--split-sentences")  # fmt: skip
    assert [Path(w.prefix).name for w in written] == [
        "topics_text_sentence",
        "topics_title_sentence",
    ]
    texts, titles = (IndexedDataset(w.prefix) for w in written)
    assert texts[0].dtype == np.uint16 and len(texts.document_indices) - 1 == len(corpus[2])
    for doc, text in enumerate(corpus[2]):
        begin, end = texts.document_indices[doc : doc + 2]
        decoded = [tokenizer.detokenize(texts[i]) for i in range(begin, end)]
        assert decoded == data.split_sentences(text)
        assert tokenizer.detokenize(titles[doc]) == f"Topic number {doc}."
    assert written[0].sequences == len(texts) and written[0].tokens == len(
        np.concatenate([texts[i] for i in range(len(texts))])
    )
    data.check_indexed_dataset(written[0].prefix, tokenizer.vocab_size)


def test_document_level_data_with_eod_and_workers(corpus, tokenizer, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    (one,) = _preprocess(corpus, tmp_path / "one", "--append-eod")
    (two,) = _preprocess(corpus, tmp_path / "two", "--append-eod", "--workers", "2")
    assert one.prefix.endswith("one_text_document")
    for suffix in (".bin", ".idx"):  # worker processes keep the order: the same bytes
        assert Path(one.prefix + suffix).read_bytes() == Path(two.prefix + suffix).read_bytes()
    dataset = IndexedDataset(one.prefix)
    assert len(dataset) == len(corpus[2]) == one.documents
    for doc, text in enumerate(corpus[2]):
        assert dataset[doc][-1] == tokenizer.eod
        # Spaces, tabs and newlines survive (megatron-core's decoder strips both ends).
        assert tokenizer.detokenize(dataset[doc][:-1]) == text.strip()


def _bert_and_gpt(rank, world, corpus, out):
    jsonl, model, _ = corpus
    tokenizer = data.load_tokenizer(model)
    common = ["--input", str(jsonl), "--tokenizer-type", "SentencePieceTokenizer",
              "--tokenizer-model", str(model)]  # fmt: skip
    (sentences,) = preprocess_tool.run(
        _parser().parse_args([*common, "--output-prefix", f"{out}/s", "--split-sentences"])
    )
    (documents,) = preprocess_tool.run(
        _parser().parse_args([*common, "--output-prefix", f"{out}/d", "--append-eod"])
    )
    bert = data.build_datasets(sentences.prefix, tokenizer, SEQ, "80,10,10", (16, 4, 4))
    gpt = data.build_gpt_datasets(documents.prefix, tokenizer, SEQ, "80,10,10", (16, 4, 4))
    return [len(d) for d in bert], [bert[0][i] for i in range(8)], [gpt[0][i] for i in range(8)]


def test_megatron_builds_bert_and_gpt_datasets_from_it(corpus, tokenizer, tmp_path):
    ((bert_sizes, bert, gpt),) = all_ok(run_local(1, _bert_and_gpt, corpus, str(tmp_path)))
    assert min(bert_sizes) >= 4
    stream = "".join(" ".join(doc.split()) for doc in corpus[2])
    documents = "\n".join(corpus[2])
    for sample in bert:
        length = int(sample["padding_mask"].sum())
        text, loss_mask, labels = sample["text"], sample["loss_mask"], sample["labels"]
        assert text[0] == tokenizer.cls and text[length - 1] == tokenizer.sep
        assert (text[:length] == tokenizer.sep).sum() == 2  # [CLS] A [SEP] B [SEP]
        assert ((labels != -1) == (loss_mask == 1)).all()
        assert loss_mask.sum() >= 1 or length < 10  # see test_bert_data._check_sample
        assert (loss_mask[text == tokenizer.mask] == 1).all()
        original = np.where(loss_mask == 1, labels, text)[:length]
        end_a = int((sample["types"][:length] == 0).sum())
        for segment in (original[1 : end_a - 1], original[end_a : length - 1]):
            assert tokenizer.detokenize(segment).strip() in stream
    for sample in gpt:
        tokens, labels = sample["tokens"].numpy(), sample["labels"].numpy()
        assert tokens.shape == labels.shape == (SEQ,)
        assert (tokens[1:] == labels[:-1]).all()  # labels are the next tokens
        # Between end-of-document tokens: runs of a document's text.
        cuts = [-1, *np.flatnonzero(tokens == tokenizer.eod), SEQ]
        for begin, end in itertools.pairwise(cuts):
            if end - begin > 2:
                assert tokenizer.detokenize(tokens[begin + 1 : end]).strip() in documents


@pytest.fixture
def bert_data_cli():
    import importlib.util

    path = Path(__file__).parents[1] / "examples" / "bert_data.py"
    if "bert_data" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bert_data", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bert_data"] = module
        spec.loader.exec_module(module)
    return sys.modules["bert_data"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokenizer-type", "SentencePieceTokenizer"], "needs --tokenizer-model"),
        (["--tokenizer-type", "BertWordPieceLowerCase"], "needs --vocab-file"),
        (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "x.model"],
         "no such tokenizer file"),
        (["--json-keys", "body"], "no string under key 'body'"),
        (["--workers", "0"], "--workers 0"),
    ],
)  # fmt: skip
def test_bad_preprocess_flags_are_one_line(corpus, tmp_path, capsys, bert_data_cli, flags, message):
    jsonl, model, _ = corpus
    argv = ["preprocess", "--input", str(jsonl), "--output-prefix", str(tmp_path / "x")]
    if "--tokenizer-type" not in flags:
        argv += ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model)]
    assert bert_data_cli.main([*argv, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err


def test_a_wordpiece_vocab_loads_through_megatron_core(tmp_path):
    vocab = tmp_path / "vocab.txt"
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s", ",", "!"]
    vocab.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(data.DataError, match="pip install transformers"):
            data.load_tokenizer(vocab)
        return
    tokenizer = data.load_tokenizer(vocab)
    assert (tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask) == (0, 2, 3, 4)
    assert tokenizer.tokenize("Hello, worlds!") == [5, 8, 6, 7, 9]
    assert tokenizer.word_start[7] is False and tokenizer.word_start[6] is True


def test_a_model_trained_elsewhere_gets_the_special_tokens_after_its_pieces(corpus, tmp_path):
    """As Megatron-LM's tokenizer does for a model without <CLS> and friends."""
    import sentencepiece

    sentences = [s for doc in corpus[2] for s in data.split_sentences(doc)]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_prefix=str(tmp_path / "plain"),
        vocab_size=400, minloglevel=2, num_threads=1,
    )  # fmt: skip
    tokenizer = data.load_tokenizer(tmp_path / "plain.model")
    specials = [tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad, tokenizer.eod]
    assert min(specials) >= 400 and len(set(specials)) == 5
    assert tokenizer.vocab_size == len(tokenizer.inv_vocab) > max(specials)
    assert tokenizer.inv_vocab[tokenizer.cls] == "<CLS>"
