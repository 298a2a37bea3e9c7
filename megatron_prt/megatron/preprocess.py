"""Megatron-LM's ``tools/preprocess_data.py`` for megatron-prt: documents -> token ids -> the
``.bin``/``.idx`` pair megatron-core's ``IndexedDataset`` reads, written by its
``IndexedDatasetBuilder``, with the tool's flag names (:func:`add_arguments`) and output names
(``PREFIX_<key>_sentence`` with ``--split-sentences``, one item per sentence, for BERT;
``PREFIX_<key>_document`` without, one item per document, for GPT).

Differences from the tool: sentences come from the regex splitter of
:func:`~megatron_prt.megatron.corpus.split_sentences` (nltk's punkt is a download); documents
without a token, or with fewer than ``--min-sentences`` sentences, are left out; with
``--split-sentences`` a sentence over 512 tokens (megatron's BERT sample mapping skips its
whole document) is cut into pieces, before a word start where one is near.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from .corpus import DataError, iter_jsonl, split_sentences
from .datasets import MAX_SENTENCE_TOKENS
from .tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer, load_tokenizer


@dataclass(frozen=True)
class Written:
    """One indexed dataset :func:`preprocess` wrote, and how much went into it."""

    prefix: str  # megatron's --data-path: PREFIX.bin and PREFIX.idx
    documents: int
    sequences: int  # items: sentences with --split-sentences, else documents
    tokens: int
    dropped_documents: int  # without a token, or with fewer than min_sentences sentences


def dataset_prefix(output_prefix: str, key: str, sentences: bool) -> str:
    """``OUTPUT_<key>_sentence`` or ``OUTPUT_<key>_document``, as preprocess_data.py names it."""
    return f"{output_prefix}_{key}_{'sentence' if sentences else 'document'}"


def encode_document(
    tokenizer: Tokenizer, text: str, *, sentences: bool, append_eod: bool
) -> list[list[int]]:
    """Token ids of ``text``: one list per sentence (``sentences``) or one for the whole text,
    empty ones left out, the end-of-document id appended to the last (``append_eod``), as
    preprocess_data.py's ``Encoder.encode``. Sentences are cut to 512 tokens (see above)."""
    pieces = split_sentences(text) if sentences else [text]
    encoded = [ids for ids in map(tokenizer.tokenize, pieces) if ids]
    if sentences:
        encoded = [cut for ids in encoded for cut in _cut_long(ids, tokenizer.word_start)]
    if encoded and append_eod:
        encoded[-1].append(tokenizer.eod)
    return encoded


def _cut_long(ids: list[int], word_start: Sequence[bool]) -> list[list[int]]:
    """``ids`` in pieces of at most :data:`MAX_SENTENCE_TOKENS`, cut before a word start in the
    second half of a piece where there is one (a single over-long word is cut anywhere)."""
    pieces = []
    while len(ids) > MAX_SENTENCE_TOKENS:
        cut = MAX_SENTENCE_TOKENS
        while cut > MAX_SENTENCE_TOKENS // 2 and not word_start[ids[cut]]:
            cut -= 1
        if not word_start[ids[cut]]:
            cut = MAX_SENTENCE_TOKENS
        pieces.append(ids[:cut])
        ids = ids[cut:]
    return [*pieces, ids] if ids else pieces


# Each worker process loads the tokenizer once (megatron-core's tokenizers do not pickle well).
_worker: dict = {}


def _start_worker(tokenizer_path: str, tokenizer_type: str, sentences: bool, eod: bool) -> None:
    _worker.update(
        tokenizer=load_tokenizer(tokenizer_path, tokenizer_type), sentences=sentences, eod=eod
    )


def _encode_record(texts: list[str]) -> list[list[list[int]]]:
    return [
        encode_document(
            _worker["tokenizer"], text, sentences=_worker["sentences"], append_eod=_worker["eod"]
        )
        for text in texts
    ]


def preprocess(
    records: Iterable[list[str]],
    keys: Sequence[str],
    output_prefix: str,
    tokenizer: Tokenizer,
    *,
    sentences: bool = False,
    append_eod: bool = False,
    workers: int = 1,
    min_sentences: int = 1,
) -> list[Written]:
    """Tokenize ``records`` (per document, one text per key of ``keys``) and write one indexed
    dataset per key, :func:`dataset_prefix` named, in the token dtype megatron picks for the
    vocabulary size. ``workers`` > 1 encodes in that many processes (order kept: the same
    inputs give the same bytes). Returns what was written, per key."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if workers < 1:
        raise DataError(f"--workers {workers}: expected 1 or more")
    prefixes = [dataset_prefix(output_prefix, key, sentences) for key in keys]
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = [IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype) for prefix in prefixes]
    counts = [[0, 0, 0, 0] for _ in keys]  # documents, sequences, tokens, dropped
    for documents in _encoded(records, tokenizer, sentences, append_eod, workers):
        for builder, count, items in zip(builders, counts, documents, strict=True):
            if len(items) < max(1, min_sentences if sentences else 1):
                count[3] += 1
                continue
            builder.add_document([t for item in items for t in item], [len(i) for i in items])
            count[0] += 1
            count[1] += len(items)
            count[2] += sum(map(len, items))
    for builder, prefix in zip(builders, prefixes, strict=True):
        builder.finalize(f"{prefix}.idx")
    return [Written(prefix, *count) for prefix, count in zip(prefixes, counts, strict=True)]


def _encoded(
    records: Iterable[list[str]],
    tokenizer: Tokenizer,
    sentences: bool,
    append_eod: bool,
    workers: int,
) -> Iterator[list[list[list[int]]]]:
    if workers == 1:
        for texts in records:
            yield [
                encode_document(tokenizer, text, sentences=sentences, append_eod=append_eod)
                for text in texts
            ]
        return
    setup = (tokenizer.path, tokenizer.tokenizer_type, sentences, append_eod)
    with multiprocessing.Pool(workers, initializer=_start_worker, initargs=setup) as pool:
        yield from pool.imap(_encode_record, records, chunksize=16)


# ----------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """preprocess_data.py's flags (those this implementation supports), same names."""
    parser.add_argument("--input", required=True, help="JSON lines file, one document a line")
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys of the texts (default: text)"
    )
    parser.add_argument("--split-sentences", action="store_true", help="one item per sentence")
    parser.add_argument("--output-prefix", required=True, help="PREFIX of PREFIX_<key>_*.bin")
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", help="SentencePiece model (SentencePiece types)")
    parser.add_argument("--vocab-file", help="WordPiece vocab.txt (BertWordPiece types)")
    parser.add_argument(
        "--append-eod", action="store_true", help="end each document with the eod token"
    )
    parser.add_argument("--workers", type=int, default=1, help="encoding processes")
    parser.add_argument(
        "--min-sentences",
        type=int,
        default=1,
        help="with --split-sentences, leave out documents with fewer sentences (2 for BERT's "
        "binary head)",
    )


def run(args: argparse.Namespace) -> list[Written]:
    """The ``preprocess`` command: :func:`preprocess` of ``args.input`` with ``args``'s flags."""
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file)
    started = time.perf_counter()
    written = preprocess(
        iter_jsonl(args.input, args.json_keys),
        args.json_keys,
        args.output_prefix,
        tokenizer,
        sentences=args.split_sentences,
        append_eod=args.append_eod,
        workers=args.workers,
        min_sentences=args.min_sentences,
    )
    for item in written:
        print(
            f"wrote {item.prefix}.{{bin,idx}}: {item.documents} documents, {item.sequences} "
            f"items, {item.tokens:,} tokens ({item.dropped_documents} documents left out) in "
            f"{time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
    return written
