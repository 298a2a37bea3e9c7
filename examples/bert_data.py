"""Offline BERT (and GPT) pretraining data for megatron-core: corpus -> SentencePiece tokenizer
-> indexed dataset -> megatron-core's BERT datasets. The work is done by
:mod:`megatron_prt.megatron.data`; this file is its command line.

    python examples/bert_data.py prepare --out data/bert                 # no download at all
    python examples/bert_data.py prepare --out data/bert --input corpus.jsonl --json-key text
    python examples/bert_data.py show --out data/bert --seq-length 128   # split sizes, a sample

    # the same in steps, as with Megatron-LM (tools/preprocess_data.py's flags):
    python examples/bert_data.py train-tokenizer --input corpus.jsonl \\
        --tokenizer-model data/spm.model --vocab-size 8192
    python examples/bert_data.py preprocess --input corpus.jsonl --json-keys text \\
        --output-prefix data/corpus --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model data/spm.model --split-sentences --workers 2   # data/corpus_text_sentence
    python examples/bert_data.py show --out data --tokenizer-model data/spm.model

Corpus. Without ``--input`` the corpus is CPython's own ``pydoc_data.topics`` (the text behind
``help("topics")``: 79 English documents, about 465k characters on Python 3.11). ``--input`` is
either ``.jsonl`` (one JSON object per line, the text under ``--json-key``; Megatron-LM's input
format) or, for ``prepare`` and ``train-tokenizer``, plain UTF-8 text with blank lines between
documents. Sentences come from a regex splitter (nltk's punkt, which Megatron-LM's
``--split-sentences`` loads, is a download). ``prepare`` leaves out documents with fewer than 2
sentences: BERT's sentence-order head needs a pair.

Tokenizer. ``prepare`` and ``train-tokenizer`` train a SentencePiece model (unigram, byte
fallback, ``--vocab-size`` pieces) with ``<PAD>`` ``<UNK>`` ``<CLS>`` ``<SEP>`` ``<MASK>``
``<BOS>`` ``<EOD>`` at ids 0-6, the names Megatron-LM's SentencePieceTokenizer looks up; it is
loaded through megatron-core's ``MegatronTokenizer``. ``--vocab-file vocab.txt`` uses a WordPiece
vocabulary instead (e.g. bert-base-uncased's; megatron-core loads it with ``transformers``).

Files ``prepare`` writes to ``--out DIR``: ``tokenizer.model`` (or ``vocab.txt``) and
``<name>_<key>_sentence.{bin,idx}``, megatron's indexed dataset, one item per sentence
(``<name>`` is ``pydoc`` or the input file's stem). Megatron-LM reads them with
``--data-path DIR/pydoc_text_sentence --tokenizer-type SentencePieceTokenizer
--tokenizer-model DIR/tokenizer.model``; examples/pretrain_bert.py with the same flags.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # run from a clone without `pip install -e .`
    sys.path.insert(0, _ROOT)

from megatron_prt.megatron import data, preprocess  # noqa: E402
from megatron_prt.megatron.data import (  # noqa: E402, F401 - the names other examples use
    DEFAULT_VOCAB_SIZE,
    MAX_SENTENCE_TOKENS,
    MIN_SENTENCES_PER_DOCUMENT,
    SPECIAL_TOKENS,
    SPLIT_NAMES,
    DataError,
    PreparedData,
    build_datasets,
    build_gpt_datasets,
    check_indexed_dataset,
    default_corpus,
    init_single_process_group,
    load_tokenizer,
    pieces_note,
    prepare,
    read_corpus,
    samples_per_epoch,
    split_document_ranges,
    split_sentences,
    train_tokenizer,
)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="train a tokenizer, write the indexed dataset")
    prep.add_argument("--out", required=True, help="output directory")
    _add_corpus_flags(prep)
    prep.add_argument("--tokenizer-model", help="use this SentencePiece model, do not train one")
    prep.add_argument("--vocab-file", help="use this WordPiece vocab.txt (needs transformers)")
    prep.add_argument(
        "--tokenizer-type",
        choices=data.TOKENIZER_TYPES,
        help="Megatron-LM's name for the given file (default: BertWordPieceLowerCase for a "
        "vocab.txt; BertWordPieceCase keeps case)",
    )
    train = commands.add_parser("train-tokenizer", help="train a SentencePiece tokenizer")
    train.add_argument("--tokenizer-model", required=True, help="where to write the .model")
    _add_corpus_flags(train)
    train.add_argument("--model-type", choices=("unigram", "bpe"), default="unigram")
    pre = commands.add_parser("preprocess", help="tools/preprocess_data.py: jsonl -> .bin/.idx")
    preprocess.add_arguments(pre)
    show = commands.add_parser("show", help="build the BERT datasets, print sizes and a sample")
    show.add_argument("--out", required=True, help="directory written by prepare")
    show.add_argument("--data-path", help="dataset prefix, if DIR holds more than one")
    show.add_argument("--tokenizer-model", help="the tokenizer file, if not DIR's own")
    show.add_argument("--seq-length", type=int, default=128)
    show.add_argument("--split", default="90,5,5")
    show.add_argument("--seed", type=int, default=1234)
    show.add_argument("--no-binary-head", dest="binary_head", action="store_false")
    return parser.parse_args(argv)


def _add_corpus_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", help=".jsonl, or text with blank lines between documents (default: pydoc_data)"
    )
    parser.add_argument("--json-key", default="text", help="text key of .jsonl lines")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help=f"SentencePiece pieces (default {DEFAULT_VOCAB_SIZE}; fewer if the corpus is small)",
    )


def _train_tokenizer(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    documents = data.corpus_documents(args.input, args.json_key)
    sentences = [s for doc in documents for s in split_sentences(doc)]
    size = train_tokenizer(
        sentences, args.tokenizer_model, args.vocab_size, model_type=args.model_type
    )
    print(
        f"wrote {args.tokenizer_model}: {pieces_note(size, args.vocab_size)}, from "
        f"{len(sentences)} sentences in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )


def _tokenizer_in(out: Path):
    for name in (data.TOKENIZER_MODEL, "vocab.txt"):
        if (out / name).is_file():
            return load_tokenizer(out / name)
    raise DataError(f"{out} holds no tokenizer.model or vocab.txt: run `prepare --out {out}` first")


def _show(args: argparse.Namespace) -> None:
    out = Path(args.out)
    prefixes = sorted(str(p.with_suffix("")) for p in out.glob("*_sentence.idx"))
    if not prefixes:
        raise DataError(f"{out} holds no prepared data: run `prepare --out {out}` first")
    if args.data_path is None and len(prefixes) > 1:
        raise DataError(f"{out} holds several datasets, pick one with --data-path: {prefixes}")
    prefix = args.data_path or prefixes[0]
    tokenizer = load_tokenizer(args.tokenizer_model) if args.tokenizer_model else _tokenizer_in(out)
    init_single_process_group()
    started = time.perf_counter()
    datasets = build_datasets(
        prefix, tokenizer, args.seq_length, args.split, seed=args.seed, binary_head=args.binary_head
    )
    sizes = ", ".join(
        f"{name} {len(d) if d is not None else 0}"
        for name, d in zip(SPLIT_NAMES, datasets, strict=True)
    )
    print(
        f"{prefix} at seq {args.seq_length}: samples {sizes} "
        f"({time.perf_counter() - started:.1f} s)"
    )
    sample = next(d for d in datasets if d is not None)[0]
    length = int(sample["padding_mask"].sum())
    print(f"first sample ({length} tokens, is_random={sample['is_random']}):")
    print(tokenizer.detokenize(sample["text"][:length]))
    labels = sample["labels"][sample["loss_mask"] == 1]
    print(f"masked labels: {tokenizer.detokenize(labels)}")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; errors in the data are one line on stderr and exit code 2."""
    args = _parse_args(argv)
    # megatron-core says so on import in every CPU run; it is not news to this program.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    try:
        if args.command == "prepare":
            prepare(
                args.out,
                args.input,
                vocab_size=args.vocab_size,
                json_key=args.json_key,
                vocab_file=args.vocab_file,
                tokenizer_model=args.tokenizer_model,
                tokenizer_type=args.tokenizer_type,
            )
        elif args.command == "train-tokenizer":
            _train_tokenizer(args)
        elif args.command == "preprocess":
            preprocess.run(args)
        else:
            _show(args)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
