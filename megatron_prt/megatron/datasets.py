"""megatron-core's BERT and GPT datasets over indexed data, with the checks that turn megatron's
deep failures and hangs (a truncated ``.bin``, ids of another vocabulary, a split without a
sample) into one-line :class:`DataError` messages.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import struct
import tempfile
from collections.abc import Callable, Sequence

from .corpus import DataError
from .tokenizer import Tokenizer, check_bert_pad

# megatron's build_mapping (helpers.cpp LONG_SENTENCE_LEN) skips any document holding a longer
# sentence; preprocessing for BERT cuts longer sentences into pieces of at most this many.
MAX_SENTENCE_TOKENS = 512


def init_single_process_group() -> None:
    """A 1-rank gloo group, for building the datasets outside ``torchrun`` (megatron's dataset
    code calls ``torch.distributed.get_rank()``). Does nothing if a group exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = os.path.join(tempfile.mkdtemp(prefix="megatron_prt_data_"), "store")
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
    "write both files again with `bert_data.py prepare` or `bert_data.py preprocess` (or "
    "Megatron-LM's tools/preprocess_data.py)"
)


def check_indexed_dataset(prefix: str, vocab_size: int | None = None) -> None:
    """Refuse ``prefix.{bin,idx}`` that megatron would fail on deep inside a run, or read
    wrongly without a word: a missing file, an index megatron-core's ``IndexedDataset``
    cannot read or whose sequence offsets do not follow its lengths, a ``.bin`` whose size
    is not what the index says (truncated, or a pair from different runs) and, given
    ``vocab_size``, a token id the vocabulary lacks (data made with another tokenizer).
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
                f"(ids 0..{vocab_size - 1}): the data was tokenized with another tokenizer; "
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
            whole = binary_head and numpy.diff(dataset.document_indices).max() <= 1
            fix = (  # one "sentence" per document everywhere: a GPT-style document dataset
                "every document of it is one sequence: preprocess the corpus with "
                "--split-sentences for BERT (a GPT dataset keeps documents whole)"
                if whole
                else "change --split or use a larger corpus"
            )
            raise DataError(
                f"the {name} set of {prefix} (documents {bounds[0]}..{bounds[1] - 1}) makes no "
                f"sample: it needs a document with {2 if binary_head else 1}+ sentences, none "
                f"over {MAX_SENTENCE_TOKENS} tokens; {fix}"
            )
        counts.append(len(mapping))
    return counts


def build_datasets(
    prefix: str,
    tokenizer: Tokenizer,
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
    up to 3-grams; megatron knows words by WordPiece's ``##`` only, so with SentencePiece it
    masks pieces). ``num_samples`` per split: at least that many samples (megatron adds whole
    passes over the split's documents until there are); None is one pass (megatron-core 0.16.1
    itself fails on None for BERT). A split weighted 0 in ``split``, or not built on this rank,
    is None. Each sample is megatron's dict: ``text``, ``types``, ``labels`` (-1 where not
    masked), ``padding_mask``, ``loss_mask`` (int64 arrays of ``seq_length``), ``is_random``,
    ``truncated``.

    Collective: every rank of the initialised ``torch.distributed`` group calls it (see
    :func:`init_single_process_group`); rank 0 builds the sample index into ``cache_dir``
    (default DIR/cache beside the data; a folder per data content, :func:`data_digest`).
    Raises :class:`DataError` where megatron would fail
    or hang (see :func:`samples_per_epoch`)."""
    import torch.distributed as dist
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    if not dist.is_initialized():
        raise DataError("torch.distributed is not initialised: call init_single_process_group()")
    check_indexed_dataset(prefix, tokenizer.vocab_size)
    check_bert_pad(tokenizer)
    epoch = samples_per_epoch(prefix, seq_length, split, seed, binary_head, short_seq_prob)
    sizes = [epoch[i] if n is None else n for i, n in enumerate(num_samples)]
    config = _bert_config(
        prefix,
        tokenizer,
        seq_length,
        split,
        seed,
        binary_head,
        cache_dir=cache_dir,
        mask_prob=mask_prob,
        short_seq_prob=short_seq_prob,
    )
    builder = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset, sizes, is_built_on_rank, config
    )
    return tuple(builder.build())


def _bert_config(
    prefix: str,
    tokenizer: Tokenizer,
    seq_length: int,
    split: str,
    seed: int,
    binary_head: bool,
    *,
    cache_dir: str | None,
    mask_prob: float,
    short_seq_prob: float,
):
    """pretrain_bert.py's ``BERTMaskedWordPieceDatasetConfig`` for :func:`build_datasets`:
    whole-word masking of up to 3-grams, sample index cached as :func:`_config_common` says."""
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig

    return BERTMaskedWordPieceDatasetConfig(
        **_config_common(prefix, tokenizer, seq_length, split, seed, cache_dir),
        masking_probability=mask_prob,
        short_sequence_probability=short_seq_prob,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=binary_head,
    )


def build_gpt_datasets(
    prefix: str,
    tokenizer: Tokenizer,
    seq_length: int,
    split: str = "90,5,5",
    num_samples: Sequence[int] = (1, 1, 1),
    seed: int = 1234,
    *,
    cache_dir: str | None = None,
    is_built_on_rank: Callable[[], bool] = lambda: True,
) -> tuple:
    """megatron-core ``GPTDataset`` (train, valid, test) over a document-level ``prefix``
    (``preprocess`` without ``--split-sentences``, with ``--append-eod``), built by
    ``BlendedMegatronDatasetBuilder``; a split weighted 0 is None. Each sample is megatron's
    dict of ``tokens``, ``labels`` (next tokens), ``loss_mask``, ``position_ids`` (and an
    ``attention_mask``). Collective, like :func:`build_datasets`."""
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if not dist.is_initialized():
        raise DataError("torch.distributed is not initialised: call init_single_process_group()")
    check_indexed_dataset(prefix, tokenizer.vocab_size)
    split_document_ranges(1, split)  # refuses weights megatron would divide by zero on
    config = GPTDatasetConfig(
        **_config_common(prefix, tokenizer, seq_length, split, seed, cache_dir),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), is_built_on_rank, config)
    return tuple(builder.build())


def _config_common(prefix, tokenizer, seq_length: int, split: str, seed: int, cache_dir) -> dict:
    """The BlendedMegatronDatasetConfig fields every dataset here sets alike: one prefix,
    megatron's split string, the sample index cached in ``cache_dir`` (default DIR/cache
    beside the data), in a folder named by the data's content (:func:`data_digest`)."""
    cache = cache_dir or os.path.join(os.path.dirname(prefix), "cache")
    return {
        "random_seed": seed,
        "sequence_length": seq_length,
        "blend": ([prefix], None),
        "split": split,
        "path_to_cache": os.path.join(cache, data_digest(prefix)),
        "tokenizer": tokenizer,
    }


def data_digest(prefix: str, whole: int = 1 << 26, edge: int = 1 << 16) -> str:
    """A name for the data at ``prefix`` (``.bin`` and ``.idx``) that changes with it:
    megatron-core keys its sample-index cache by path, tokenizer, seed, split and sample
    count, not by content, so data rewritten at the same prefix loaded the old index (samples
    across document ends, or past the new data's end). The sizes of both files and the whole
    index (sentence lengths and document bounds, what the sample index is made of) up to
    ``whole`` bytes (64 MiB: some 5 million sentences, 0.1 s); beyond, its first and last
    ``edge`` bytes (reading a larger index on every start would cost seconds). The same on
    every copy of the data. Beyond ``whole``, a rewrite keeping both sizes and the index's
    ends (sentence lengths permuted in the middle alone) would still read the old index:
    remove the cache folder after such a rewrite."""
    digest = hashlib.md5(usedforsecurity=False)
    for suffix in (".bin", ".idx"):
        digest.update(str(os.path.getsize(prefix + suffix)).encode())
    size = os.path.getsize(prefix + ".idx")
    with open(prefix + ".idx", "rb") as index:
        if size <= whole:
            for block in iter(lambda: index.read(1 << 20), b""):
                digest.update(block)
        else:
            digest.update(index.read(edge))
            index.seek(size - edge)
            digest.update(index.read(edge))
    return f"data-{digest.hexdigest()[:16]}"
