"""Tokenizers of the data path: a SentencePiece model trained with the ``sentencepiece``
package, or an existing WordPiece ``vocab.txt``, both loaded through megatron-core's own
tokenizers (``megatron.core.tokenizers.MegatronTokenizer.from_pretrained``).

Special tokens. The SentencePiece model holds BERT's and GPT's special tokens under the names
Megatron-LM's ``SentencePieceTokenizer`` looks up (``<CLS>``, ``<SEP>``, ``<MASK>``, ``<EOD>``,
the model's pad/bos/eos pieces), at fixed ids :data:`SPECIAL_TOKENS` (``<PAD>`` = 0 as in
BERT), trained as control symbols: sentencepiece never encodes text to them (megatron-core's
``legacy`` mode, below, does map the literal strings ``<CLS>``, ``<SEP>``, ... in a text to
their ids, as Megatron-LM's tokenizer does). So Megatron-LM's
``--tokenizer-type SentencePieceTokenizer --tokenizer-model tokenizer.model`` sees the same
ids and vocabulary size as megatron-core's tokenizer here.

Limits of megatron-core 0.16.1 (why :class:`Tokenizer` wraps its tokenizer):

- Its ``SentencePieceTokenizer`` reports cls/sep/mask only in ``legacy`` mode with the tokens
  named at load time; :func:`load_tokenizer` passes them.
- Its ``inv_vocab`` is rebuilt from the model on every access, and BERT's masking reads it
  for every token of every sample; :class:`Tokenizer` builds it once.
- Whole-word masking recognises WordPiece's ``##`` continuations only: with SentencePiece
  every piece is a masking unit (as in Megatron-LM).
- Its ``BertWordPieceLowerCase`` tokenizer (library ``megatron``) downloads
  bert-large-uncased's configuration from the Hugging Face hub; a local ``vocab.txt`` is
  loaded through its ``huggingface`` library instead (``transformers`` needed, no network).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .corpus import DataError

# id -> piece of the trained SentencePiece models; pad, unk, bos and eos are sentencepiece's
# own meta pieces, the rest control symbols. The eos piece is <EOD>: megatron-core's GPT
# data reads eod as eos, Megatron-LM's tokenizer reads the <EOD> piece; both find id 6.
SPECIAL_TOKENS = ("<PAD>", "<UNK>", "<CLS>", "<SEP>", "<MASK>", "<BOS>", "<EOD>")
DEFAULT_VOCAB_SIZE = 4096
_BYTE_PIECES = 256  # byte fallback: any character encodes, so decoding gives the text back
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
WORDPIECE_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")
TOKENIZER_TYPES = SENTENCEPIECE_TYPES + WORDPIECE_TYPES


def pieces_note(size: int, asked: int) -> str:
    """What a progress line says of a trained vocabulary of ``size`` for ``asked``: a small
    text can run out of pieces (``hard_vocab_limit`` off), which a user should hear of."""
    if size >= asked:
        return f"{size} pieces"
    return f"{size} pieces, fewer than the {asked} of --vocab-size: the text holds no more"


def train_tokenizer(
    sentences: Iterable[str],
    model_path: str | os.PathLike,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    model_type: str = "unigram",
) -> int:
    """Train a SentencePiece model on ``sentences`` (one training line each) and write it to
    ``model_path``; returns its vocabulary size (``vocab_size``, or fewer when the text runs
    out of pieces). No normalisation, white space kept, byte fallback: decoding the ids of
    any text gives it back (megatron-core's decoder strips white space at its ends; inner
    spaces, tabs and newlines stay). Deterministic (one thread).
    Raises :class:`DataError` for a ``vocab_size`` below the special tokens and the 256 byte
    pieces, or a text sentencepiece cannot train on."""
    import sentencepiece

    smallest = len(SPECIAL_TOKENS) + _BYTE_PIECES + 1
    if vocab_size < smallest:
        raise DataError(f"--vocab-size {vocab_size} is too small: the special tokens and "
                        f"byte pieces alone take {smallest - 1}")  # fmt: skip
    # sentencepiece skips lines of over max_sentence_length bytes, which is how it is meant.
    lines = (s for s in sentences if s.strip())
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_writer=model,
            model_type=model_type,
            vocab_size=vocab_size,
            hard_vocab_limit=False,  # a small corpus gives a smaller vocabulary, not an error
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            byte_fallback=True,
            character_coverage=0.9995,
            pad_id=0, pad_piece="<PAD>", unk_id=1, unk_piece="<UNK>",
            bos_id=5, bos_piece="<BOS>", eos_id=6, eos_piece="<EOD>",
            control_symbols=["<CLS>", "<SEP>", "<MASK>"],
            num_threads=1,
            minloglevel=2,
        )  # fmt: skip
    except RuntimeError as exc:  # sentencepiece's errors are RuntimeErrors
        raise DataError(f"sentencepiece cannot train on this text: {exc}") from None
    Path(model_path).write_bytes(model.getvalue())
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    return processor.get_piece_size()


@dataclass
class Tokenizer:
    """A megatron-core tokenizer (``megatron`` attribute) with what megatron-core's BERT and
    GPT datasets and this package read, computed once: ``vocab_size``, ``vocab``,
    ``inv_vocab``, ``cls``, ``sep``, ``mask``, ``pad``, ``eod``, ``unique_identifiers`` (the
    model file's md5 included, so megatron's sample-index cache notices a retrained model)
    , ``word_start`` (per id: whether the piece begins a word) and ``vocab_digest`` (sha256 of
    the pieces in id order: what each embedding row stands for, whatever file held them).
    Encoding and decoding go through megatron-core's tokenizer."""

    megatron: Any
    tokenizer_type: str  # Megatron-LM's --tokenizer-type: one of TOKENIZER_TYPES
    path: str  # the .model or vocab.txt
    inv_vocab: dict[int, str] = field(init=False, repr=False)

    @property
    def kind(self) -> str:
        """``sentencepiece`` or ``wordpiece``."""
        return "sentencepiece" if self.tokenizer_type in SENTENCEPIECE_TYPES else "wordpiece"

    def __post_init__(self) -> None:
        self.inv_vocab = dict(self.megatron.inv_vocab)
        self.vocab = {piece: index for index, piece in self.inv_vocab.items()}
        self.vocab_size = int(self.megatron.vocab_size)
        for name in ("cls", "sep", "mask", "pad", "eod"):
            setattr(self, name, int(getattr(self.megatron, name)))
        if self.kind == "sentencepiece":
            self.word_start = [p.startswith("▁") or p in SPECIAL_TOKENS for p in self._pieces()]
        else:
            self.word_start = [not p.startswith("##") for p in self._pieces()]
        pieces = "\n".join(self._pieces()).encode()
        self.vocab_digest = hashlib.sha256(pieces).hexdigest()  # the ids' meaning, not the file
        digest = hashlib.md5(Path(self.path).read_bytes(), usedforsecurity=False).hexdigest()
        self.unique_identifiers = {
            **self.megatron.unique_identifiers,
            "tokenizer_path": self.path,
            "tokenizer_md5": digest,
        }
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    def _pieces(self) -> list[str]:
        return [self.inv_vocab.get(index, "") for index in range(self.vocab_size)]

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no [CLS]/[SEP] added), by megatron-core's tokenizer."""
        return list(self.megatron.tokenize(text))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, by megatron-core's tokenizer."""
        return self.megatron.detokenize([int(i) for i in ids])


def load_tokenizer(path: str | os.PathLike, tokenizer_type: str | None = None) -> Tokenizer:
    """The tokenizer in ``path`` through megatron-core: a SentencePiece ``.model`` (as
    :func:`train_tokenizer` writes; special tokens a model trained elsewhere lacks get ids after
    its pieces, as in Megatron-LM) or a WordPiece ``vocab.txt``. ``tokenizer_type`` takes
    Megatron-LM's names (:data:`TOKENIZER_TYPES`); None reads a ``.txt`` as WordPiece and
    anything else as SentencePiece. Raises :class:`DataError` for a missing file, a file that
    is no SentencePiece model, or a ``vocab.txt`` when ``transformers`` is not installed."""
    path = str(path)
    if not os.path.isfile(path):
        raise DataError(f"no such tokenizer file: {path}")
    if tokenizer_type is None:
        tokenizer_type = _infer_type(path)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return Tokenizer(_load_sentencepiece(path), tokenizer_type, path)
    if tokenizer_type in WORDPIECE_TYPES:
        lower_case = tokenizer_type == "BertWordPieceLowerCase"
        return Tokenizer(_load_wordpiece(path, lower_case), tokenizer_type, path)
    raise DataError(f"--tokenizer-type {tokenizer_type}: expected one of {TOKENIZER_TYPES}")


def check_bert_pad(tokenizer: Tokenizer) -> None:
    """megatron-core's BERT samples take pad id 0 for granted: the padding mask holds the
    pad id where it pads (any id >= 1 reads as "attend") and the segment types too, so with
    another pad id every padded position was attended, without a word."""
    if tokenizer.pad != 0:
        raise DataError(
            f"{tokenizer.path}: its pad id is {tokenizer.pad}; megatron-core's BERT dataset "
            "needs pad id 0 (with another it marks padding as tokens to attend); train the "
            "SentencePiece model with pad_id=0 (`python examples/bert_data.py prepare` trains "
            "one) or give a WordPiece --vocab-file"
        )


def _infer_type(path: str) -> str:
    """A ``.txt`` is a WordPiece vocab (one token a line), anything else a SentencePiece model."""
    return "BertWordPieceLowerCase" if path.endswith(".txt") else "SentencePieceTokenizer"


def _load_sentencepiece(path: str) -> Any:
    from megatron.core.tokenizers import MegatronTokenizer

    try:
        megatron = MegatronTokenizer.from_pretrained(
            tokenizer_path=path,
            metadata_path={"library": "sentencepiece", "model_type": "bert"},
            legacy=True,  # megatron-core reports cls/sep/mask only so
            special_tokens=_sp_specials(path),
        )
    except ModuleNotFoundError as exc:
        raise DataError(f"{exc}: pip install sentencepiece") from None
    except RuntimeError as exc:  # sentencepiece's "ParseFromArray failed"
        raise DataError(f"{path} is not a SentencePiece model ({exc})") from None
    return megatron


def _sp_specials(path: str) -> dict[str, str]:
    """megatron-core's special tokens for the SentencePiece model at ``path``, added in the
    order of Megatron-LM's legacy ``_SentencePieceTokenizer``: ``<CLS>``, ``<SEP>``, ``<EOD>``
    (megatron-core's eos: its data reads eod as eos), ``<MASK>``, then the model's own pad,
    bos and eos pieces (``<PAD>``, ``<BOS>``, ``<EOS>`` where it has none). Pieces a model
    lacks are appended in that order, so ids and vocabulary size come out as Megatron-LM's
    (an order of our own gave a model trained elsewhere other ids: eod 805 for 802)."""
    import sentencepiece

    try:
        model = sentencepiece.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as exc:  # sentencepiece's "ParseFromArray failed"
        raise DataError(f"{path} is not a SentencePiece model ({exc})") from None

    def own(index: int, default: str) -> str:
        return model.id_to_piece(index) if 0 <= index < model.get_piece_size() else default

    out = {"cls_token": "<CLS>", "sep_token": "<SEP>", "eos_token": "<EOD>"}
    out |= {"mask_token": "<MASK>", "pad_token": own(model.pad_id(), "<PAD>")}
    out["bos_token"] = own(model.bos_id(), "<BOS>")
    eos = own(model.eos_id(), "<EOS>")
    if eos != "<EOD>":  # Megatron-LM adds the model's eos too (ours is <EOD> itself)
        out["legacy_eos_token"] = eos
    return out


def _load_wordpiece(path: str, lower_case: bool) -> Any:
    """megatron-core's ``huggingface`` library over a local folder holding the vocab and a
    ``tokenizer_config.json`` (a BertTokenizer), kept under a name derived from the vocab's
    md5: every rank and run sees the same path, so megatron's dataset cache key agrees."""
    from megatron.core.tokenizers import MegatronTokenizer

    digest = hashlib.md5(Path(path).read_bytes(), usedforsecurity=False).hexdigest()
    folder = Path(tempfile.gettempdir()) / "megatron-prt-wordpiece" / f"{digest}-{lower_case}"
    if not (folder / "tokenizer_config.json").is_file():
        _write_hf_folder(path, folder, lower_case)
    try:
        megatron = MegatronTokenizer.from_pretrained(
            tokenizer_path=str(folder),
            metadata_path={"library": "huggingface", "model_type": "bert"},
            vocab_file=str(folder / "vocab.txt"),
        )
    except (ImportError, NameError, ValueError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(
            f"megatron-core cannot load WordPiece vocab {path} ({why}): its BERT WordPiece "
            "tokenizer needs `pip install transformers`"
        ) from None
    if any(getattr(megatron, n, None) is None for n in ("cls", "sep", "mask", "pad")):
        raise DataError(f"vocab {path} lacks one of [CLS] [SEP] [MASK] [PAD]")
    return megatron


def _write_hf_folder(vocab: str, folder: Path, lower_case: bool) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent))
    (staging / "vocab.txt").write_bytes(Path(vocab).read_bytes())
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": lower_case}
    (staging / "tokenizer_config.json").write_text(json.dumps(config))
    try:
        staging.rename(folder)  # atomic: ranks racing here all see a complete folder
    except OSError:  # another process got there first
        for child in staging.iterdir():
            child.unlink()
        staging.rmdir()


def build_tokenizer(
    tokenizer_type: str, tokenizer_model: str | None = None, vocab_file: str | None = None
) -> Tokenizer:
    """Megatron-LM's flags to a tokenizer: ``--tokenizer-model`` for the SentencePiece types,
    ``--vocab-file`` for the WordPiece ones. Raises :class:`DataError` naming the missing flag."""
    if tokenizer_type in SENTENCEPIECE_TYPES:
        if tokenizer_model is None:
            raise DataError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
        return load_tokenizer(tokenizer_model, tokenizer_type)
    if tokenizer_type in WORDPIECE_TYPES:
        if vocab_file is None:
            raise DataError(f"--tokenizer-type {tokenizer_type} needs --vocab-file")
        return load_tokenizer(vocab_file, tokenizer_type)
    raise DataError(f"--tokenizer-type {tokenizer_type}: expected one of {TOKENIZER_TYPES}")


def tokenizer_args(tokenizer: Tokenizer) -> Sequence[str]:
    """Megatron-LM's flags that load ``tokenizer``."""
    file_flag = "--tokenizer-model" if tokenizer.kind == "sentencepiece" else "--vocab-file"
    return ("--tokenizer-type", tokenizer.tokenizer_type, file_flag, tokenizer.path)
