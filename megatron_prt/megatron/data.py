"""The BERT data path in one call: corpus -> SentencePiece tokenizer -> sentence-level indexed
dataset (:func:`prepare`), over :mod:`.corpus`, :mod:`.tokenizer`, :mod:`.preprocess` and
:mod:`.datasets`, whose public names are re-exported here.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .corpus import DataError, default_corpus, is_json, iter_jsonl, read_corpus, split_sentences
from .datasets import (
    MAX_SENTENCE_TOKENS,
    SPLIT_NAMES,
    build_datasets,
    build_gpt_datasets,
    check_indexed_dataset,
    init_single_process_group,
    samples_per_epoch,
    split_document_ranges,
)
from .preprocess import Written, dataset_prefix, encode_document, preprocess
from .tokenizer import (
    DEFAULT_VOCAB_SIZE,
    SENTENCEPIECE_TYPES,
    SPECIAL_TOKENS,
    TOKENIZER_TYPES,
    WORDPIECE_TYPES,
    Tokenizer,
    build_tokenizer,
    check_bert_pad,
    load_tokenizer,
    pieces_note,
    tokenizer_args,
    train_tokenizer,
)

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "MAX_SENTENCE_TOKENS",
    "MIN_SENTENCES_PER_DOCUMENT",
    "SPECIAL_TOKENS",
    "SPLIT_NAMES",
    "TOKENIZER_TYPES",
    "DataError",
    "PreparedData",
    "Tokenizer",
    "Written",
    "build_datasets",
    "build_gpt_datasets",
    "build_tokenizer",
    "check_indexed_dataset",
    "dataset_prefix",
    "default_corpus",
    "encode_document",
    "init_single_process_group",
    "is_json",
    "iter_jsonl",
    "load_tokenizer",
    "prepare",
    "preprocess",
    "read_corpus",
    "samples_per_epoch",
    "split_document_ranges",
    "split_sentences",
    "tokenizer_args",
    "train_tokenizer",
]

MIN_SENTENCES_PER_DOCUMENT = 2  # BERT's binary head samples sentence pairs
TOKENIZER_MODEL = "tokenizer.model"  # what prepare trains, in its output folder


def _progress(message: str) -> None:
    print(f"[bert_data] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class PreparedData:
    """What :func:`prepare` wrote and how much of it."""

    prefix: str  # DIR/<name>_<key>_sentence: megatron's --data-path
    tokenizer_file: str  # DIR/tokenizer.model (SentencePiece) or DIR/vocab.txt (WordPiece)
    vocab_size: int
    documents: int  # written (each with >= 2 sentences)
    sentences: int
    tokens: int
    dropped_documents: int  # read but with fewer than 2 sentences

    @property
    def vocab_file(self) -> str:
        """The tokenizer file (the name examples/pretrain_bert.py reads)."""
        return self.tokenizer_file


def corpus_documents(input_path: str | os.PathLike | None, json_key: str) -> list[str]:
    """:func:`default_corpus` when ``input_path`` is None, else :func:`read_corpus`."""
    return default_corpus() if input_path is None else read_corpus(input_path, json_key)


def prepare(
    out_dir: str | os.PathLike,
    input_path: str | os.PathLike | None = None,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    json_key: str = "text",
    vocab_file: str | os.PathLike | None = None,
    tokenizer_model: str | os.PathLike | None = None,
    tokenizer_type: str | None = None,
) -> PreparedData:
    """Write a tokenizer and the sentence-level indexed dataset of the corpus (see
    :func:`corpus_documents`) into ``out_dir``, replacing an earlier preparation and its
    sample-index cache. The tokenizer: a SentencePiece model of ``vocab_size`` trained on the
    corpus's sentences (``tokenizer.model``), or a copy of ``tokenizer_model`` (SentencePiece)
    or ``vocab_file`` (WordPiece ``vocab.txt``; needs ``transformers``), loaded as
    ``tokenizer_type`` (Megatron-LM's name; default: the file's kind, a ``vocab.txt`` as
    ``BertWordPieceLowerCase``: give ``BertWordPieceCase`` for a cased one). Documents with fewer
    than 2 sentences are left out (BERT's binary head needs a pair). The same inputs give the
    same bytes. Raises :class:`DataError` when no document is left. The corpus is held in
    memory: for larger ones use ``train-tokenizer`` and ``preprocess``, which stream."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    documents = corpus_documents(input_path, json_key)
    source = "pydoc_data.topics" if input_path is None else str(input_path)
    _progress(f"read {len(documents)} documents ({sum(map(len, documents)):,} chars) from {source}")
    # Refused before the tokenizer is written: a refused corpus leaves the folder as it was.
    if not any(len(split_sentences(doc)) >= MIN_SENTENCES_PER_DOCUMENT for doc in documents):
        raise DataError(
            f"no document of {source} has {MIN_SENTENCES_PER_DOCUMENT} sentences: "
            "BERT needs sentence pairs (end sentences with . ! or ?)"
        )
    tokenizer = _prepare_tokenizer(
        out, documents, vocab_size, vocab_file, tokenizer_model, tokenizer_type
    )
    check_bert_pad(tokenizer)  # before the corpus is written with it: BERT data only
    name = "pydoc" if input_path is None else Path(input_path).stem
    key = json_key if input_path is not None and is_json(input_path) else "text"
    (written,) = preprocess(
        ([doc] for doc in documents),
        [key],
        str(out / name),
        tokenizer,
        sentences=True,
        min_sentences=MIN_SENTENCES_PER_DOCUMENT,
    )
    if not written.documents:  # every pair lost in tokenization (the check above reads text)
        raise DataError(
            f"no document of {source} kept {MIN_SENTENCES_PER_DOCUMENT} sentences once "
            "tokenized: BERT needs sentence pairs"
        )
    shutil.rmtree(out / "cache", ignore_errors=True)  # sample indices of the old data
    prepared = PreparedData(
        prefix=written.prefix,
        tokenizer_file=tokenizer.path,
        vocab_size=tokenizer.vocab_size,
        documents=written.documents,
        sentences=written.sequences,
        tokens=written.tokens,
        dropped_documents=written.dropped_documents,
    )
    _progress(
        f"wrote {prepared.prefix}.{{bin,idx}}: {prepared.documents} documents, "
        f"{prepared.sentences} sentences, {prepared.tokens:,} tokens "
        f"({prepared.dropped_documents} documents with < {MIN_SENTENCES_PER_DOCUMENT} "
        f"sentences left out) in {time.perf_counter() - started:.1f} s; Megatron-LM: "
        f"--data-path {prepared.prefix} {' '.join(tokenizer_args(tokenizer))}"
    )
    return prepared


def _check_tokenizer_type(kind: str | None, vocab_file, tokenizer_model) -> None:
    """``--tokenizer-type`` names the kind of the file given: without one it was ignored (a
    SentencePiece model trained), of another kind the file read as what it is not."""
    if kind is None:
        return
    if vocab_file is None and tokenizer_model is None:
        raise DataError(
            f"--tokenizer-type {kind} names the type of a given tokenizer file: add "
            "--vocab-file or --tokenizer-model, or drop it (prepare then trains a SentencePiece "
            "model)"
        )
    wanted = WORDPIECE_TYPES if vocab_file is not None else SENTENCEPIECE_TYPES
    if kind not in wanted:
        flag = "--vocab-file" if vocab_file is not None else "--tokenizer-model"
        raise DataError(f"--tokenizer-type {kind} with {flag}: give one of {', '.join(wanted)}")


def _prepare_tokenizer(
    out: Path,
    documents: list[str],
    vocab_size: int,
    vocab_file: str | os.PathLike | None,
    tokenizer_model: str | os.PathLike | None,
    tokenizer_type: str | None = None,
) -> Tokenizer:
    if vocab_file is not None and tokenizer_model is not None:
        raise DataError("pass --vocab-file (WordPiece) or --tokenizer-model, not both")
    _check_tokenizer_type(tokenizer_type, vocab_file, tokenizer_model)
    given, name = (vocab_file, "vocab.txt") if vocab_file else (tokenizer_model, TOKENIZER_MODEL)
    path = out / name
    if given is not None:
        if not Path(given).is_file():
            raise DataError(f"no such tokenizer file: {given}")
        if Path(given).resolve() != path.resolve():
            shutil.copyfile(given, path)
        default = "BertWordPieceLowerCase" if vocab_file else None
        return load_tokenizer(path, tokenizer_type or default)
    started = time.perf_counter()
    sentences = [s for doc in documents for s in split_sentences(doc)]
    _progress(f"training a SentencePiece tokenizer of {vocab_size} on {len(sentences)} sentences")
    size = train_tokenizer(sentences, path, vocab_size)
    note = pieces_note(size, vocab_size)
    _progress(f"wrote {path}: {note} ({time.perf_counter() - started:.1f} s)")
    return load_tokenizer(path)
