"""The IMDB data of ``examples/imdb_finetune.py`` (its docstring describes the folders and
the files): the aclImdb folder layout read and converted to token arrays, a synthetic folder
made, converted folders loaded and served as micro-batches."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch loads lazily: make-tiny and convert do not need it
    import torch

_EXAMPLES_DIR = str(Path(__file__).resolve().parent)
if _EXAMPLES_DIR not in sys.path:
    sys.path.insert(0, _EXAMPLES_DIR)
from bert_data import DataError, load_tokenizer, split_sentences, train_tokenizer  # noqa: E402

LABELS = ("neg", "pos")  # label id = index, as the folder names say
SPLITS = ("train", "test")
FIELDS = ("tokens", "padding_mask", "label", "rating")
DEFAULT_SEQ_LENGTH = 512
DEFAULT_VOCAB_SIZE = 8192
FORMAT_VERSION = 1
_REVIEW_NAME = re.compile(r"^(\d+)_(\d+)\.txt$")  # aclImdb's <id>_<rating>.txt
_HTML_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)


def _progress(message: str) -> None:
    print(f"[imdb] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------ aclImdb folders


@dataclass(frozen=True)
class Review:
    """One review file: cleaned text, label (index into :data:`LABELS`), star rating (-1 if
    the file name carries none)."""

    text: str
    label: int
    rating: int


def check_layout(root: str | os.PathLike) -> None:
    """Raise :class:`DataError` (one line) unless ``root`` holds ``{train,test}/{pos,neg}``
    folders with at least one ``.txt`` review each."""
    root = Path(root)
    folders = [f"{split}/{label}" for split in SPLITS for label in LABELS]
    missing = [name for name in folders if not (root / name).is_dir()]
    if missing:
        raise DataError(
            f"{root} is not an aclImdb folder: {', '.join(missing)} missing (expected "
            "{train,test}/{pos,neg}/<id>_<rating>.txt)"
        )
    empty = [name for name in folders if not any((root / name).glob("*.txt"))]
    if empty:
        raise DataError(f"{root}: {', '.join(empty)} hold no .txt review")


def clean_review(text: str) -> str:
    """The review text with HTML line breaks turned into spaces."""
    return _HTML_BREAK.sub(" ", text)


def _review_order(path: Path) -> tuple[int, str]:
    # Numeric ids sort as numbers (aclImdb's 2_9.txt before 10_7.txt), others by name after.
    match = _REVIEW_NAME.match(path.name)
    return (int(match.group(1)) if match else sys.maxsize, path.name)


def read_split(root: str | os.PathLike, split: str) -> list[Review]:
    """The reviews of ``root/split``: negatives, then positives, each by file id."""
    reviews = []
    for label, name in enumerate(LABELS):
        for path in sorted((Path(root) / split / name).glob("*.txt"), key=_review_order):
            match = _REVIEW_NAME.match(path.name)
            text = path.read_text(encoding="utf-8", errors="replace")
            rating = int(match.group(2)) if match else -1
            reviews.append(Review(clean_review(text), label, rating))
    return reviews


# ------------------------------------------------------------------------------ convert


def encode_review(tokenizer, text: str, seq_length: int) -> tuple[list[int], bool]:
    """``([CLS] ids [SEP])`` cut to ``seq_length`` (the [SEP] is kept) and whether it was cut."""
    ids = tokenizer.tokenize(text)
    room = seq_length - 2
    return [tokenizer.cls, *ids[:room], tokenizer.sep], len(ids) > room


def encode_split(
    reviews: Sequence[Review], tokenizer, seq_length: int
) -> tuple[dict[str, np.ndarray], int]:
    """The arrays of :data:`FIELDS` for ``reviews`` and how many reviews were truncated."""
    token_dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    tokens = np.full((len(reviews), seq_length), tokenizer.pad, dtype=token_dtype)
    mask = np.zeros((len(reviews), seq_length), dtype=np.uint8)
    truncated = 0
    for row, review in enumerate(reviews):
        ids, cut = encode_review(tokenizer, review.text, seq_length)
        tokens[row, : len(ids)] = ids
        mask[row, : len(ids)] = 1
        truncated += cut
    arrays = {
        "tokens": tokens,
        "padding_mask": mask,
        "label": np.array([r.label for r in reviews], dtype=np.uint8),
        "rating": np.array([r.rating for r in reviews], dtype=np.int8),
    }
    return arrays, truncated


def _tokenizer_for(out: Path, train: Sequence[Review], vocab_file, vocab_size: int):
    """``vocab_file`` copied into ``out`` (a ``.txt`` is a WordPiece vocab, anything else a
    SentencePiece model), or a SentencePiece model trained on the ``train`` reviews."""
    is_wordpiece = vocab_file is not None and str(vocab_file).endswith(".txt")
    path = out / ("vocab.txt" if is_wordpiece else "tokenizer.model")
    if vocab_file is not None:
        if not Path(vocab_file).is_file():
            raise DataError(f"no such vocab file: {vocab_file}")
        if Path(vocab_file).resolve() != path.resolve():
            shutil.copyfile(vocab_file, path)
    else:
        sentences = [s for review in train for s in split_sentences(review.text)]
        _progress(f"training a SentencePiece tokenizer of {vocab_size} on {len(sentences):,} "
                  "sentences")  # fmt: skip
        train_tokenizer(sentences, path, vocab_size)
    return load_tokenizer(path)


def convert(
    root: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    seq_length: int = DEFAULT_SEQ_LENGTH,
    vocab_file: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> dict:
    """Write the arrays of both splits, the tokenizer and ``meta.json`` (see the module
    docstring) into ``out_dir``; returns the meta dict. The same inputs give the same bytes.
    Raises :class:`DataError` for a folder not in the aclImdb layout, a missing or unusable
    vocab file, or ``seq_length`` < 3."""
    if seq_length < 3:
        raise DataError(f"--seq-length {seq_length} leaves no room for text ([CLS] x [SEP])")
    check_layout(root)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reviews = {split: read_split(root, split) for split in SPLITS}
    _progress(", ".join(f"{s}: {len(reviews[s])} reviews" for s in SPLITS) + f" from {root}")
    tokenizer = _tokenizer_for(out, reviews["train"], vocab_file, vocab_size)
    meta = {
        "format": FORMAT_VERSION,
        "seq_length": seq_length,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": Path(tokenizer.path).name,
        "labels": list(LABELS),
        "splits": {},
    }
    for split in SPLITS:
        arrays, truncated = encode_split(reviews[split], tokenizer, seq_length)
        for field in FIELDS:
            np.save(out / f"{split}_{field}.npy", arrays[field])
        meta["splits"][split] = {
            "samples": len(reviews[split]),
            "positive": int(arrays["label"].sum()),
            "truncated": truncated,
        }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


# ------------------------------------------------------------------------------ make-tiny

_POSITIVE_WORDS = ("great", "wonderful", "brilliant", "superb", "excellent", "delightful",
                   "moving", "beautiful")  # fmt: skip
_NEGATIVE_WORDS = ("awful", "boring", "terrible", "dull", "worst", "horrible", "waste",
                   "stupid")  # fmt: skip
_NEUTRAL_WORDS = ("the", "movie", "film", "plot", "acting", "story", "scene", "cast",
                  "director", "ending", "music", "was", "and", "a", "with", "this", "of", "it",
                  "is", "really", "quite", "i", "thought", "characters")  # fmt: skip


def _tiny_review(rng: random.Random, label: int) -> str:
    """3 short sentences of neutral words, each holding two words of the review's sentiment;
    one in four reviews also holds one word of the other (so a single word does not decide)."""
    own, other = (_POSITIVE_WORDS, _NEGATIVE_WORDS) if label else (_NEGATIVE_WORDS, _POSITIVE_WORDS)
    sentences = []
    for _ in range(3):
        words = rng.choices(_NEUTRAL_WORDS, k=rng.randint(3, 5))
        for word in rng.sample(own, 2):
            words.insert(rng.randrange(len(words) + 1), word)
        sentences.append(words)
    if rng.random() < 0.25:
        noisy = rng.choice(sentences)
        noisy.insert(rng.randrange(len(noisy) + 1), rng.choice(other))
    text = [" ".join(words).capitalize() + "." for words in sentences]
    return " ".join(text[:2]) + "<br /><br />" + text[2]  # aclImdb's paragraph break


def make_tiny(
    out_root: str | os.PathLike,
    *,
    train_per_class: int = 64,
    test_per_class: int = 32,
    seed: int = 0,
) -> None:
    """Write a synthetic aclImdb folder (``{train,test}/{pos,neg}/<id>_<rating>.txt``,
    ratings 7-10 positive, 1-4 negative) into ``out_root``, which must not hold files yet.
    Deterministic for a given ``seed``."""
    root = Path(out_root)
    if root.exists() and any(root.iterdir()):
        raise DataError(f"{root} is not empty: make-tiny writes a fresh folder")
    for split_index, (split, count) in enumerate(
        (("train", train_per_class), ("test", test_per_class))
    ):
        for label, name in enumerate(LABELS):
            rng = random.Random(seed * 100 + split_index * 10 + label)
            folder = root / split / name
            folder.mkdir(parents=True)
            for review_id in range(count):
                rating = rng.randint(7, 10) if label else rng.randint(1, 4)
                text = _tiny_review(rng, label)
                (folder / f"{review_id}_{rating}.txt").write_text(text, encoding="utf-8")


# ------------------------------------------------------------------------ converted data


def read_meta(data_dir: str | os.PathLike) -> dict:
    """``meta.json`` of a converted folder; :class:`DataError` if it is not one."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise DataError(
            f"{data_dir} holds no converted IMDB data (no meta.json): run "
            f"`imdb_finetune.py convert --imdb ROOT --out {data_dir}` first"
        )
    meta = json.loads(path.read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT_VERSION:
        raise DataError(f"{path} has format {meta.get('format')}, expected {FORMAT_VERSION}")
    return meta


@dataclass(frozen=True)
class ImdbSplit:
    """A converted split as torch tensors: ``tokens`` ``[N, seq]`` int32, ``padding_mask``
    ``[N, seq]`` uint8 (1 = token), ``label`` ``[N]`` int64 (compact: micro-batches widen)."""

    tokens: torch.Tensor
    padding_mask: torch.Tensor
    label: torch.Tensor

    def __len__(self) -> int:
        return len(self.label)


def load_split(data_dir: str | os.PathLike, split: str) -> ImdbSplit:
    """The arrays ``convert`` wrote for ``split``."""
    import torch

    def array(field):
        return np.load(Path(data_dir) / f"{split}_{field}.npy")

    return ImdbSplit(
        tokens=torch.from_numpy(array("tokens").astype(np.int32)),
        padding_mask=torch.from_numpy(array("padding_mask")),
        label=torch.from_numpy(array("label").astype(np.int64)),
    )


# ------------------------------------------------------------------------------- batches


class ShuffledIndices:
    """An endless stream of sample indices ``0..n-1``: one seeded permutation per epoch, the
    same on every rank."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples, self.seed = num_samples, seed
        self.epoch, self.pending = 0, np.empty(0, dtype=np.int64)

    def take(self, count: int) -> np.ndarray:
        while len(self.pending) < count:
            rng = np.random.default_rng([self.seed, self.epoch])
            self.pending = np.concatenate([self.pending, rng.permutation(self.num_samples)])
            self.epoch += 1
        taken, self.pending = self.pending[:count], self.pending[count:]
        return taken


def microbatches(
    data: ImdbSplit, indices: np.ndarray, dp_rank: int, dp_size: int, micro_batch_size: int
) -> list[dict]:
    """This data-parallel rank's share of a global batch (``indices``, -1 = a padding slot)
    cut into micro-batches: dicts of ``tokens``, ``padding_mask``, ``label``, ``valid``."""
    import torch

    share = len(indices) // dp_size
    mine = torch.from_numpy(indices[dp_rank * share : (dp_rank + 1) * share])
    valid = mine >= 0
    rows = mine.clamp(min=0)  # padding slots repeat sample 0; ``valid`` leaves them out
    batch = {
        "tokens": data.tokens[rows].long(),
        "padding_mask": data.padding_mask[rows].long(),
        "label": data.label[rows],
        "valid": valid,
    }
    return [
        {key: value[start : start + micro_batch_size] for key, value in batch.items()}
        for start in range(0, share, micro_batch_size)
    ]


def eval_batches(num_samples: int, global_batch: int, limit: int | None) -> Iterator[np.ndarray]:
    """Global batches covering ``0..num_samples-1`` once (at most ``limit`` of them), the
    last padded with -1 so every call runs full micro-batches. The order is one fixed
    shuffle, the same in every run: the split is stored by class, and ``limit`` must still
    sample both."""
    order = np.random.default_rng(0).permutation(num_samples)
    count = -(-num_samples // global_batch)
    padded = np.full(count * global_batch, -1, dtype=np.int64)
    padded[:num_samples] = order
    for batch in range(min(count, limit or count)):
        yield padded[batch * global_batch : (batch + 1) * global_batch]
