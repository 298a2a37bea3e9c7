"""Text for the data path, standard library only: the embedded corpus, ``.jsonl`` and plain
text files, and the sentence splitter of ``--split-sentences``.

Megatron-LM's ``tools/preprocess_data.py`` splits sentences with nltk's punkt model, which is a
download; :func:`split_sentences` is a regex splitter that needs nothing.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path


class DataError(ValueError):
    """A corpus, tokenizer, dataset or split that cannot make training data; the message is
    one line naming the file or flag and the fix."""


_UNDERLINE = re.compile(r"^[ \t]*([=*\-~^\"#+])\1{3,}[ \t]*$", re.MULTILINE)
# A sentence ends at . ! or ? (plus closing quotes/brackets) followed by white space and an
# upper-case letter, a digit or an opening quote/bracket.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_ABBREVIATIONS = frozenset({"e.g.", "i.e.", "cf.", "vs.", "mr.", "mrs.", "ms.", "dr."})
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def default_corpus() -> list[str]:
    """The documents of CPython's ``pydoc_data.topics`` (the text behind ``help("topics")``,
    about 465k characters of English on Python 3.11), one per topic, sorted by topic name,
    with reStructuredText heading underlines removed (they are not text)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions ship the stdlib without it
        raise DataError(
            "this Python has no pydoc_data.topics; pass --input with a corpus of your own"
        ) from exc
    return [_UNDERLINE.sub("", topics[name]) for name in sorted(topics)]


def is_json(path: str | os.PathLike) -> bool:
    """Whether ``path`` is read as JSON lines (``.jsonl``/``.json``) rather than plain text."""
    return Path(path).suffix in (".jsonl", ".json")


def iter_jsonl(path: str | os.PathLike, json_keys: Sequence[str]) -> Iterator[list[str]]:
    """The strings under ``json_keys`` of each non-blank line of a JSON-lines file (Megatron-LM's
    ``preprocess_data.py --input`` format), streamed. Raises :class:`DataError` naming the
    file and line for a missing or non-UTF-8 file, a line that is not a JSON object, or one
    without a string under some key."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no such corpus file: {path}")
    with open(path, encoding="utf-8", newline="\n") as lines:
        number = 0
        try:
            # Lines end at \n only: JSON strings may hold U+2028 and friends.
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield _record_strings(line, json_keys, f"{path}:{number}")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{path} is not UTF-8 text ({exc.reason} after line {number})"
            ) from None


def _record_strings(line: str, json_keys: Sequence[str], where: str) -> list[str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, expected an object")
    for key in json_keys:
        if not isinstance(record.get(key), str):
            raise DataError(f"{where}: no string under key {key!r} (has {sorted(record)})")
    return [record[key] for key in json_keys]


def read_corpus(path: str | os.PathLike, json_key: str = "text") -> list[str]:
    """The documents of a ``.jsonl``/``.json`` file (the ``json_key`` string of each line) or of
    a plain text file (blank-line separated). Raises :class:`DataError` for a missing or
    non-UTF-8 file, a bad JSON line (see :func:`iter_jsonl`) or a corpus without text."""
    path = Path(path)
    if is_json(path):
        documents = [strings[0] for strings in iter_jsonl(path, [json_key])]
    else:
        if not path.is_file():
            raise DataError(f"no such corpus file: {path}")
        try:
            documents = _BLANK_LINE.split(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from None
    documents = [doc for doc in documents if doc.strip()]
    if not documents:
        raise DataError(f"corpus {path} holds no text")
    return documents


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: paragraphs (blank-line separated) with white space collapsed,
    cut after ``.``, ``!`` or ``?`` when a capital, digit or opening quote follows, except
    after a few abbreviations (``e.g.``). Every sentence is non-empty."""
    sentences = []
    for paragraph in _BLANK_LINE.split(text):
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
