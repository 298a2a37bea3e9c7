"""Offline BERT pretraining data for megatron-core: corpus -> WordPiece vocab -> sentence-level
indexed dataset -> megatron-core ``BERTMaskedWordPieceDataset`` train/valid/test splits.

    python examples/bert_data.py prepare --out data/bert                 # no download at all
    python examples/bert_data.py prepare --out data/bert --input corpus.jsonl --json-key text
    python examples/bert_data.py prepare --out data/bert --input book.txt --vocab-size 8192
    python examples/bert_data.py show --out data/bert --seq-length 128   # split sizes, a sample

Corpus. Without ``--input`` the corpus is CPython's own ``pydoc_data.topics`` (the text behind
``help("topics")``: 79 English documents, about 465k characters on Python 3.11, shipped with the
standard library, so it varies a little between Python versions), one document per topic. To
train on your own text, pass ``--input FILE``, either

- ``.jsonl`` (or ``.json``): one JSON object per line, the text under ``--json-key``
  (Megatron-LM's ``tools/preprocess_data.py`` input format), one document per line; or
- any other file, read as UTF-8 plain text, documents separated by blank lines.

Sentences come from a regex splitter (nltk's punkt model, which Megatron-LM's
``--split-sentences`` loads, is a download). Documents with fewer than 2 sentences are left out:
BERT's next-sentence (binary) head needs 2, and megatron's sample mapping never finishes on a
split without such a document.

Files written to ``--out DIR``:

- ``vocab.txt``: a WordPiece vocabulary trained on the corpus (deterministic; ``--vocab-file``
  uses an existing one instead, e.g. bert-base-uncased's).
- ``<name>_<key>_sentence.{bin,idx}``: megatron's indexed dataset, one item per sentence, named
  as ``preprocess_data.py --split-sentences`` names it (``<name>`` is ``pydoc`` or the input
  file's stem, ``<key>`` the JSON key, ``text`` for plain text).

Megatron-LM reads the same files: ``--data-path DIR/pydoc_text_sentence --vocab-file
DIR/vocab.txt --tokenizer-type BertWordPieceLowerCase --legacy-tokenizer``; the token ids equal
those of its legacy ``BertWordPieceLowerCase`` tokenizer, which :class:`WordPieceTokenizer`
reimplements because ``megatron.training`` is not part of the megatron-core wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import time
import unicodedata
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

# [PAD] first so that padding is id 0 as in BERT; [BOS]/[EOS] are the two tokens Megatron-LM's
# legacy BERT tokenizer appends when a vocab lacks them: listing them keeps vocab.txt's line
# count equal to the vocab size every consumer sees.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[BOS]", "[EOS]")
DEFAULT_VOCAB_SIZE = 4096
MIN_SENTENCES_PER_DOCUMENT = 2  # what BERT's binary head samples need
# megatron's build_mapping (helpers.cpp LONG_SENTENCE_LEN) skips any document holding a longer
# sentence, so longer sentences are cut into pieces of at most this many tokens.
MAX_SENTENCE_TOKENS = 512
MAX_WORD_CHARS = 200  # longer words become [UNK], as in BERT's WordpieceTokenizer


class DataError(ValueError):
    """A corpus, vocabulary or split that cannot make BERT data; the message is one line."""


def _progress(message: str) -> None:
    print(f"[bert_data] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------- corpus


_UNDERLINE = re.compile(r"^[ \t]*([=*\-~^\"#+])\1{3,}[ \t]*$", re.MULTILINE)
# A sentence ends at . ! or ? (plus closing quotes/brackets) followed by white space and an
# upper-case letter, a digit or an opening quote/bracket.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_ABBREVIATIONS = frozenset({"e.g.", "i.e.", "cf.", "vs.", "mr.", "mrs.", "ms.", "dr."})


def default_corpus() -> list[str]:
    """The documents of CPython's ``pydoc_data.topics``, one per topic, sorted by topic name,
    with reStructuredText heading underlines removed (they are not text)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions ship the stdlib without it
        raise DataError(
            "this Python has no pydoc_data.topics; pass --input with a corpus of your own"
        ) from exc
    return [_UNDERLINE.sub("", topics[name]) for name in sorted(topics)]


def read_corpus(path: str | os.PathLike, json_key: str = "text") -> list[str]:
    """The documents of a ``.jsonl``/``.json`` file (the ``json_key`` string of each line) or of
    a plain text file (blank-line separated). Raises :class:`DataError` for a missing or
    non-UTF-8 file, a line that is not a JSON object with a string under ``json_key``, or a
    corpus without text."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no such corpus file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if _is_json(path):
        documents = _jsonl_documents(text, json_key, path)
    else:
        documents = re.split(r"\n[ \t]*\n", text)
    documents = [doc for doc in documents if doc.strip()]
    if not documents:
        raise DataError(f"corpus {path} holds no text")
    return documents


def _is_json(path: str | os.PathLike) -> bool:
    return Path(path).suffix in (".jsonl", ".json")


def _jsonl_documents(text: str, json_key: str, path: Path) -> list[str]:
    documents = []
    # Lines end at \n only: JSON strings may hold U+2028 and friends, which splitlines() cuts.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{number}: no string under key {json_key!r} (has {keys})")
        documents.append(record[json_key])
    return documents


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: paragraphs (blank-line separated) with white space collapsed,
    cut after ``.``, ``!`` or ``?`` when a capital, digit or opening quote follows, except
    after a few abbreviations (``e.g.``). Every sentence is non-empty."""
    sentences = []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        flat = " ".join(paragraph.split())
        start = 0
        for end in _SENTENCE_END.finditer(flat):
            sentence = flat[start : end.end()].rstrip()
            last_word = sentence.rsplit(" ", 1)[-1].lower().rstrip("\"')]")
            if last_word not in _ABBREVIATIONS:
                sentences.append(sentence)
                start = end.end()
        sentences.append(flat[start:])
    return [s for s in sentences if s]


# ------------------------------------------------------------------------------ tokenizer
#
# BERT's BasicTokenizer (lower case) and WordpieceTokenizer, as in Megatron-LM's
# megatron/training/tokenizer/bert_tokenization.py, so that the ids match its legacy
# BertWordPieceLowerCase tokenizer token for token.


def _is_whitespace(char: str) -> bool:
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def _is_control(char: str) -> bool:
    return char not in "\t\n\r" and unicodedata.category(char) in ("Cc", "Cf")


def _is_punctuation(char: str) -> bool:
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def _clean(text: str) -> str:
    """Drop NUL, U+FFFD and control characters, turn white space into spaces, and surround
    CJK ideographs with spaces (each one becomes a word)."""
    out = []
    for char in text:
        cp = ord(char)
        if cp == 0 or cp == 0xFFFD or _is_control(char):
            continue
        if _is_whitespace(char):
            out.append(" ")
        elif _is_cjk(cp):
            out.append(f" {char} ")
        else:
            out.append(char)
    return "".join(out)


def _strip_accents(word: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFD", word) if unicodedata.category(c) != "Mn")


def _split_punctuation(word: str) -> list[str]:
    pieces: list[str] = []
    run = ""
    for char in word:
        if _is_punctuation(char):
            pieces.extend((run, char) if run else (char,))
            run = ""
        else:
            run += char
    return [*pieces, run] if run else pieces


# ASCII text takes one regex: no CJK, no accents, punctuation is exactly string.punctuation.
_ASCII_CONTROL = {cp: None for cp in (*range(32), 127) if chr(cp) not in "\t\n\r"}
_ASCII_WORDS = re.compile(r"[!-/:-@\[-`{-~]|[^\s!-/:-@\[-`{-~]+")


def basic_tokenize(text: str) -> list[str]:
    """BERT's lower-casing BasicTokenizer: clean, lower case, strip accents, and split on
    white space and punctuation (every punctuation character is a word of its own)."""
    if text.isascii():
        return _ASCII_WORDS.findall(text.translate(_ASCII_CONTROL).lower())
    words = []
    for word in _clean(text).split():
        words.extend(_split_punctuation(_strip_accents(word.lower())))
    return words


def wordpiece(word: str, vocab: Mapping[str, int]) -> list[str]:
    """Greedy longest-match-first WordPiece pieces of one basic-tokenized word; ``[UNK]`` alone
    if some part of it matches no piece or it is longer than 200 characters."""
    if len(word) > MAX_WORD_CHARS:
        return ["[UNK]"]
    pieces = []
    start = 0
    while start < len(word):
        end = len(word)
        while end > start:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                break
            end -= 1
        if end == start:
            return ["[UNK]"]
        pieces.append(piece)
        start = end
    return pieces


def load_vocab(path: str | os.PathLike) -> dict[str, int]:
    """token -> id from a vocab.txt (one token a line, id = line number), as BERT reads it."""
    vocab: dict[str, int] = {}
    with open(path, encoding="utf-8") as lines:
        for index, line in enumerate(lines):
            vocab[line.strip()] = index
    return vocab


class WordPieceTokenizer:
    """Megatron-LM's legacy ``BertWordPieceLowerCase`` tokenizer (``_BertWordPieceTokenizer``
    over BERT's ``FullTokenizer``) for megatron-core alone: what ``BERTMaskedWordPieceDataset``
    and ``pretrain_bert.py`` use (``vocab``, ``inv_vocab``, ``vocab_size``, ``cls``, ``sep``,
    ``pad``, ``mask``, ``bos``, ``eos``, ``eod``, ``tokenize``, ``detokenize``,
    ``unique_identifiers``). ``[BOS]``/``[EOS]`` are appended when the file lacks them, as
    Megatron-LM does, so ``vocab_size`` matches it for any vocab.txt."""

    def __init__(self, vocab_file: str | os.PathLike) -> None:
        self.vocab_file = str(vocab_file)
        self.vocab = load_vocab(vocab_file)
        missing = [t for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]") if t not in self.vocab]
        if missing:
            raise DataError(f"vocab {vocab_file} lacks the special tokens {missing}")
        for token in ("[BOS]", "[EOS]"):
            self.vocab.setdefault(token, len(self.vocab))
        self.inv_vocab = {index: token for token, index in self.vocab.items()}
        self._pieces: dict[str, list[int]] = {}  # word -> ids: corpora repeat words a lot
        # Part of megatron's dataset cache key: the vocab's bytes, not just its path.
        digest = hashlib.md5(Path(vocab_file).read_bytes(), usedforsecurity=False).hexdigest()
        self.unique_identifiers = {
            "class": type(self).__name__,
            "tokenizer_path": [self.vocab_file],
            "vocab_md5": digest,
            "lower_case": "True",
        }
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    cls = property(lambda self: self.vocab["[CLS]"])
    sep = property(lambda self: self.vocab["[SEP]"])
    pad = property(lambda self: self.vocab["[PAD]"])
    mask = property(lambda self: self.vocab["[MASK]"])
    bos = property(lambda self: self.vocab["[BOS]"])
    eos = property(lambda self: self.vocab["[EOS]"])
    eod = eos  # Megatron-LM's BERT tokenizer: eod is eos

    def encode_words(self, words: Iterable[str]) -> list[int]:
        """Token ids of basic-tokenized words."""
        ids: list[int] = []
        for word in words:
            pieces = self._pieces.get(word)
            if pieces is None:
                pieces = [self.vocab[p] for p in wordpiece(word, self.vocab)]
                self._pieces[word] = pieces
            ids.extend(pieces)
        return ids

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no [CLS]/[SEP] added)."""
        return self.encode_words(basic_tokenize(text))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Readable text of ids: pieces joined, ``##`` continuations glued to their word."""
        return " ".join(self.inv_vocab[int(i)] for i in ids).replace(" ##", "")


# ------------------------------------------------------------------------ vocab training


def train_wordpiece_vocab(
    word_counts: Mapping[str, int],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    limit_alphabet: int = 1000,
) -> list[str]:
    """A WordPiece vocabulary of at most ``vocab_size`` tokens, as HF ``tokenizers`` trains one
    (byte-pair merges over words split into a first character and ``##`` continuations), but
    deterministic: ties go to the alphabetically first pair (HF's trainer breaks them in hash
    order, so its vocab changes from run to run).

    Order: :data:`SPECIAL_TOKENS`, the alphabet (the ``limit_alphabet`` most frequent
    characters, each as a word start and as a ``##`` continuation), then merged pieces in merge
    order. Merging stops at ``vocab_size`` or when no pair occurs ``min_frequency`` times.
    Raises :class:`DataError` if the special tokens and alphabet alone exceed ``vocab_size``."""
    alphabet = _alphabet(word_counts, limit_alphabet)
    vocab = [*SPECIAL_TOKENS, *sorted(alphabet), *sorted("##" + c for c in alphabet)]
    if len(vocab) > vocab_size:
        raise DataError(
            f"vocab size {vocab_size} is too small: special tokens and the corpus alphabet "
            f"need {len(vocab)}"
        )
    words = [
        (_initial_pieces(word), count)
        for word, count in sorted(word_counts.items())
        if set(word) <= alphabet
    ]
    vocab.extend(_merges(words, vocab_size - len(vocab), min_frequency, set(vocab)))
    return vocab


def _alphabet(word_counts: Mapping[str, int], limit: int) -> set[str]:
    char_counts: Counter[str] = Counter()
    for word, count in word_counts.items():
        for char in word:
            char_counts[char] += count
    ranked = sorted(char_counts.items(), key=lambda item: (-item[1], item[0]))
    return {char for char, _ in ranked[:limit]}


def _initial_pieces(word: str) -> list[str]:
    return [word[0], *("##" + c for c in word[1:])]


def _merge_pair(pieces: list[str], a: str, b: str, merged: str) -> list[str]:
    out = []
    i = 0
    while i < len(pieces):
        if i + 1 < len(pieces) and pieces[i] == a and pieces[i + 1] == b:
            out.append(merged)
            i += 2
        else:
            out.append(pieces[i])
            i += 1
    return out


def _merges(
    words: list[tuple[list[str], int]], budget: int, min_frequency: int, known: set[str]
) -> list[str]:
    """Up to ``budget`` new tokens from byte-pair merges of ``words`` (pieces, count), most
    frequent pair first; updates pair counts incrementally (only words holding the pair)."""
    pair_counts: Counter[tuple[str, str]] = Counter()
    holders: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for index, (pieces, count) in enumerate(words):
        for pair in pairwise(pieces):
            pair_counts[pair] += count
            holders[pair].add(index)
    # Max-heap by count, then alphabetical pair; entries whose count changed since are stale.
    heap = [(-count, a, b) for (a, b), count in pair_counts.items()]
    heapq.heapify(heap)
    new_tokens: list[str] = []
    while heap and len(new_tokens) < budget:
        negative_count, a, b = heapq.heappop(heap)
        if pair_counts.get((a, b)) != -negative_count:
            continue
        if -negative_count < min_frequency:
            break
        merged = a + b[2:]
        if merged not in known:
            known.add(merged)
            new_tokens.append(merged)
        touched: set[tuple[str, str]] = set()
        for index in holders.pop((a, b)):
            pieces, count = words[index]
            new_pieces = _merge_pair(pieces, a, b, merged)
            for pair in pairwise(pieces):
                pair_counts[pair] -= count
                touched.add(pair)
            for pair in pairwise(new_pieces):
                pair_counts[pair] += count
                holders[pair].add(index)
                touched.add(pair)
            words[index] = (new_pieces, count)
        for pair in touched:
            if pair_counts[pair] > 0:
                heapq.heappush(heap, (-pair_counts[pair], *pair))
            else:
                del pair_counts[pair]
    return new_tokens


def write_vocab(tokens: Sequence[str], path: str | os.PathLike) -> None:
    """One token a line, UTF-8, ``\\n`` line ends (byte-identical on every platform)."""
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        out.writelines(f"{token}\n" for token in tokens)


# ------------------------------------------------------------------------------ prepare


@dataclass(frozen=True)
class PreparedData:
    """What :func:`prepare` wrote and how much of it."""

    prefix: str  # DIR/<name>_<key>_sentence: megatron's --data-path
    vocab_file: str
    vocab_size: int  # the tokenizer's (vocab.txt lines, plus [BOS]/[EOS] if it lacked them)
    documents: int  # written (each with >= 2 sentences)
    sentences: int
    tokens: int
    dropped_documents: int  # read but with fewer than 2 sentences


def prepare(
    out_dir: str | os.PathLike,
    input_path: str | os.PathLike | None = None,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    json_key: str = "text",
    vocab_file: str | os.PathLike | None = None,
) -> PreparedData:
    """Write ``vocab.txt`` (trained on the corpus unless ``vocab_file`` is given) and the
    sentence-level indexed dataset of the corpus (:func:`default_corpus` when ``input_path`` is
    None, else :func:`read_corpus`) into ``out_dir``, replacing an earlier preparation and its
    sample-index cache. The same inputs give the same bytes. Raises :class:`DataError` when no
    document has 2 sentences. The corpus is held in memory: meant for corpora of up to some
    hundred MB (Megatron-LM's ``preprocess_data.py`` streams larger ones)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if input_path is None:
        name, documents = "pydoc", default_corpus()
        source = "pydoc_data.topics"
    else:
        name, documents = Path(input_path).stem, read_corpus(input_path, json_key)
        source = str(input_path)
    _progress(f"read {len(documents)} documents ({sum(map(len, documents)):,} chars) from {source}")
    words = [[basic_tokenize(s) for s in split_sentences(doc)] for doc in documents]
    words = [[w for w in doc if w] for doc in words]  # sentences of punctuation-free nothing
    vocab_path = out / "vocab.txt"
    if vocab_file is None:
        _train_and_write_vocab(words, vocab_size, vocab_path)
    elif Path(vocab_file).resolve() != vocab_path.resolve():
        shutil.copyfile(vocab_file, vocab_path)
    tokenizer = WordPieceTokenizer(vocab_path)
    kept = _encode_documents(words, tokenizer)
    if not kept:
        raise DataError(
            f"no document of {source} has {MIN_SENTENCES_PER_DOCUMENT} sentences: "
            "BERT needs sentence pairs (end sentences with . ! or ?)"
        )
    key = json_key if input_path is not None and _is_json(input_path) else "text"
    prefix = str(out / f"{name}_{key}_sentence")
    _write_indexed_dataset(prefix, kept, tokenizer.vocab_size)
    shutil.rmtree(out / "cache", ignore_errors=True)  # sample indices of the old data
    prepared = PreparedData(
        prefix=prefix,
        vocab_file=str(vocab_path),
        vocab_size=tokenizer.vocab_size,
        documents=len(kept),
        sentences=sum(len(doc) for doc in kept),
        tokens=sum(len(s) for doc in kept for s in doc),
        dropped_documents=len(documents) - len(kept),
    )
    _progress(
        f"wrote {prefix}.{{bin,idx}}: {prepared.documents} documents, {prepared.sentences} "
        f"sentences, {prepared.tokens:,} tokens ({prepared.dropped_documents} documents with "
        f"< {MIN_SENTENCES_PER_DOCUMENT} sentences left out) in "
        f"{time.perf_counter() - started:.1f} s"
    )
    return prepared


def _train_and_write_vocab(words: list[list[list[str]]], vocab_size: int, path: Path) -> None:
    started = time.perf_counter()
    counts = Counter(w for doc in words for sentence in doc for w in sentence)
    _progress(f"training a WordPiece vocab of {vocab_size} on {len(counts):,} distinct words ...")
    tokens = train_wordpiece_vocab(counts, vocab_size)
    write_vocab(tokens, path)
    _progress(f"wrote {path}: {len(tokens)} tokens in {time.perf_counter() - started:.1f} s")


def _encode_documents(
    words: list[list[list[str]]], tokenizer: WordPieceTokenizer
) -> list[list[list[int]]]:
    """Token ids per sentence per document, long sentences cut, documents with fewer than
    :data:`MIN_SENTENCES_PER_DOCUMENT` sentences dropped."""
    kept = []
    for doc in words:
        sentences = []
        for sentence in doc:
            sentences.extend(_cut_long(tokenizer.encode_words(sentence), tokenizer.inv_vocab))
        if len(sentences) >= MIN_SENTENCES_PER_DOCUMENT:
            kept.append(sentences)
    return kept


def _cut_long(ids: list[int], inv_vocab: Mapping[int, str]) -> list[list[int]]:
    """``ids`` in pieces of at most :data:`MAX_SENTENCE_TOKENS`, cut before a word start where
    one is near enough (a single over-long word is cut anywhere)."""
    pieces = []
    while len(ids) > MAX_SENTENCE_TOKENS:
        cut = MAX_SENTENCE_TOKENS
        while cut > MAX_SENTENCE_TOKENS // 2 and inv_vocab[ids[cut]].startswith("##"):
            cut -= 1
        if inv_vocab[ids[cut]].startswith("##"):
            cut = MAX_SENTENCE_TOKENS
        pieces.append(ids[:cut])
        ids = ids[cut:]
    return [*pieces, ids] if ids else pieces


def _write_indexed_dataset(prefix: str, documents: list[list[list[int]]], vocab_size: int) -> None:
    """``prefix.{bin,idx}`` exactly as preprocess_data.py writes them: one item per sentence,
    the dtype megatron picks for the vocab size."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(vocab_size))
    for sentences in documents:
        builder.add_document([t for s in sentences for t in s], [len(s) for s in sentences])
    builder.finalize(f"{prefix}.idx")


# ------------------------------------------------------------------------------ datasets


def init_single_process_group() -> None:
    """A 1-rank gloo group, for building the datasets outside ``torchrun`` (megatron's dataset
    code calls ``torch.distributed.get_rank()``). Does nothing if a group exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = os.path.join(tempfile.mkdtemp(prefix="bert_data_"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


SPLIT_NAMES = ("train", "valid", "test")


def split_document_ranges(num_documents: int, split: str) -> list[tuple[int, int] | None]:
    """The [begin, end) document range of train/valid/test for ``split`` ("90,5,5"), computed
    as megatron's BlendedMegatronDatasetBuilder does; None for a split weighted 0."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    try:  # megatron reads any digits it finds and divides by their sum: "a,b" is 0/0
        weights = [float(w) for w in re.split(r"[,/]", split)]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or min(weights) < 0 or not 0 < sum(weights) < math.inf:
        raise DataError(
            f"--split {split!r}: expected up to three weights >= 0 for train,valid,test such "
            "as 90,5,5, not all 0"
        )
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [
        None
        if bookends is None
        else (round(bookends[0] * num_documents), round(bookends[1] * num_documents))
        for bookends in matrix
    ]


_REWRITE = (
    "write both files again with `bert_data.py prepare` (or Megatron-LM's tools/preprocess_data.py)"
)


def check_indexed_dataset(prefix: str, vocab_size: int | None = None) -> None:
    """Refuse ``prefix.{bin,idx}`` that megatron would fail on deep inside a run, or read
    wrongly without a word: a missing file, an index megatron-core's ``IndexedDataset``
    cannot read or whose sequence offsets do not follow its lengths, a ``.bin`` whose size
    is not what the index says (truncated, or a pair from different runs) and, given
    ``vocab_size``, a token id the vocabulary lacks (data made with another vocab.txt).
    Raises :class:`DataError` naming the file and the fix. Cost: the index is read, the
    ``.bin`` is scanned once for its largest id (seconds for Wikipedia-size data)."""
    import numpy

    # IndexedDataset's own index reader; IndexedDataset itself complains from __del__ when
    # the index it was given cannot be read
    from megatron.core.datasets.indexed_dataset import _IndexReader

    idx, bin_ = f"{prefix}.idx", f"{prefix}.bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise DataError(f"{path} does not exist (a dataset is a .bin and an .idx); {_REWRITE}")
    try:
        index = _IndexReader(idx, multimodal=False)
        if index.sequence_lengths.shape[0] != index.document_indices[-1]:
            raise ValueError("its document indices do not end at its sequence count")
    except (AssertionError, ValueError, IndexError, struct.error) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{idx} is not a readable megatron index ({why}); {_REWRITE}") from None
    itemsize = numpy.dtype(index.dtype).itemsize
    lengths = index.sequence_lengths.astype(numpy.int64)
    offsets = numpy.concatenate([[0], numpy.cumsum(lengths * itemsize)])
    if not numpy.array_equal(index.sequence_pointers, offsets[:-1]):
        raise DataError(
            f"{idx} is corrupted: its sequence offsets do not follow its lengths; {_REWRITE}"
        )
    expected, actual = int(offsets[-1]), os.path.getsize(bin_)
    if actual != expected:
        state = "truncated" if actual < expected else "longer than its index says"
        raise DataError(
            f"{bin_} holds {actual} bytes but {idx} describes {expected}: the .bin is {state} "
            f"(an interrupted copy, or a .bin and .idx from different runs); {_REWRITE}"
        )
    if vocab_size is not None and expected:
        largest = int(numpy.memmap(bin_, dtype=index.dtype, mode="r").max())
        if largest >= vocab_size:
            raise DataError(
                f"{bin_} holds token id {largest}, but the vocabulary has {vocab_size} tokens "
                f"(ids 0..{vocab_size - 1}): the data was tokenized with another vocab.txt; "
                "pass that one, or prepare the data again with this one"
            )


def samples_per_epoch(
    prefix: str,
    seq_length: int,
    split: str = "90,5,5",
    seed: int = 1234,
    binary_head: bool = True,
    short_seq_prob: float = 0.1,
) -> list[int]:
    """Samples in one pass over each split's documents (train, valid, test; 0 for a split
    weighted 0), from megatron's own sample mapping (``helpers.build_mapping``) with the
    arguments ``BERTMaskedWordPieceDataset`` gives it. Raises :class:`DataError` where megatron
    would fail instead: a used split with no document (IndexError) or no sample (the mapping
    never finishes), or ``seq_length`` < 5 ([CLS] A [SEP] B [SEP]). A document makes samples
    if it has 2 sentences for the binary head (1 without) and none over 512 tokens. Cost: one
    pass of megatron's C++ mapping over the sentence lengths (seconds for Wikipedia-size data).
    """
    import numpy
    from megatron.core.datasets import helpers
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if seq_length < 5:
        raise DataError(f"sequence length {seq_length} leaves no room for text (need >= 5)")
    check_indexed_dataset(prefix)
    dataset = IndexedDataset(prefix)
    num_documents = len(dataset.document_indices) - 1
    counts = []
    for name, bounds in zip(SPLIT_NAMES, split_document_ranges(num_documents, split), strict=True):
        if bounds is None:
            counts.append(0)
            continue
        if bounds[0] == bounds[1]:
            raise DataError(f"split {split!r} leaves the {name} set of {prefix} no document")
        mapping = helpers.build_mapping(
            dataset.document_indices[bounds[0] : bounds[1] + 1],
            dataset.sequence_lengths,
            1,  # one epoch
            numpy.iinfo(numpy.int64).max,
            seq_length - 3,  # [CLS] and two [SEP]
            short_seq_prob,
            seed,
            False,
            2 if binary_head else 1,
        )
        if len(mapping) == 0:
            raise DataError(
                f"the {name} set of {prefix} (documents {bounds[0]}..{bounds[1] - 1}) makes no "
                f"sample: it needs a document with {2 if binary_head else 1}+ sentences, none "
                f"over {MAX_SENTENCE_TOKENS} tokens; change --split or use a larger corpus"
            )
        counts.append(len(mapping))
    return counts


def build_datasets(
    prefix: str,
    tokenizer: WordPieceTokenizer,
    seq_length: int,
    split: str = "90,5,5",
    num_samples: Sequence[int | None] = (None, None, None),
    seed: int = 1234,
    binary_head: bool = True,
    *,
    cache_dir: str | None = None,
    is_built_on_rank: Callable[[], bool] = lambda: True,
    mask_prob: float = 0.15,
    short_seq_prob: float = 0.1,
) -> tuple:
    """megatron-core ``BERTMaskedWordPieceDataset`` (train, valid, test) over ``prefix``, built
    by ``BlendedMegatronDatasetBuilder`` with pretrain_bert.py's config (whole-word masking,
    up to 3-grams). ``num_samples`` per split: at least that many samples (megatron adds whole
    passes over the split's documents until there are); None is one pass (megatron-core 0.16.1
    itself fails on None for BERT). A split weighted 0 in ``split``, or not built on this rank,
    is None. Each sample is megatron's dict: ``text``, ``types``, ``labels`` (-1 where not
    masked), ``padding_mask``, ``loss_mask`` (int64 arrays of ``seq_length``), ``is_random``,
    ``truncated``.

    Collective: every rank of the initialised ``torch.distributed`` group calls it (see
    :func:`init_single_process_group`); rank 0 builds the sample index into ``cache_dir``
    (default DIR/cache beside the data). Raises :class:`DataError` where megatron would fail
    or hang (see :func:`samples_per_epoch`)."""
    import torch.distributed as dist
    from megatron.core.datasets.bert_dataset import (
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
    )
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    if not dist.is_initialized():
        raise DataError("torch.distributed is not initialised: call init_single_process_group()")
    check_indexed_dataset(prefix, tokenizer.vocab_size)
    epoch = samples_per_epoch(prefix, seq_length, split, seed, binary_head, short_seq_prob)
    sizes = [epoch[i] if n is None else n for i, n in enumerate(num_samples)]
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        path_to_cache=cache_dir or os.path.join(os.path.dirname(prefix), "cache"),
        tokenizer=tokenizer,
        masking_probability=mask_prob,
        short_sequence_probability=short_seq_prob,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=binary_head,
    )
    builder = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset, sizes, is_built_on_rank, config
    )
    return tuple(builder.build())


# ----------------------------------------------------------------------------------- CLI


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="write vocab.txt and the indexed dataset")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument(
        "--input", help=".jsonl, or text with blank lines between documents (default: pydoc_data)"
    )
    prep.add_argument("--json-key", default="text", help="text key of .jsonl lines")
    prep.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help=f"tokens in the trained vocab.txt (default {DEFAULT_VOCAB_SIZE}; fewer if the "
        "corpus runs out of pieces seen twice)",
    )
    prep.add_argument("--vocab-file", help="use this vocab.txt instead of training one")
    show = commands.add_parser("show", help="build the BERT datasets, print sizes and a sample")
    show.add_argument("--out", required=True, help="directory written by prepare")
    show.add_argument("--data-path", help="dataset prefix, if DIR holds more than one")
    show.add_argument("--seq-length", type=int, default=128)
    show.add_argument("--split", default="90,5,5")
    show.add_argument("--seed", type=int, default=1234)
    show.add_argument("--no-binary-head", dest="binary_head", action="store_false")
    return parser.parse_args(argv)


def _show(args: argparse.Namespace) -> None:
    out = Path(args.out)
    prefixes = sorted(str(p.with_suffix("")) for p in out.glob("*_sentence.idx"))
    if not prefixes or not (out / "vocab.txt").is_file():
        raise DataError(f"{out} holds no prepared data: run `prepare --out {out}` first")
    if args.data_path is None and len(prefixes) > 1:
        raise DataError(f"{out} holds several datasets, pick one with --data-path: {prefixes}")
    prefix = args.data_path or prefixes[0]
    tokenizer = WordPieceTokenizer(out / "vocab.txt")
    init_single_process_group()
    started = time.perf_counter()
    datasets = build_datasets(
        prefix,
        tokenizer,
        args.seq_length,
        args.split,
        seed=args.seed,
        binary_head=args.binary_head,
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
            )
        else:
            _show(args)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
