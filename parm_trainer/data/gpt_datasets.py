"""Train/valid/test GPT datasets over megatron.core indexed datasets.

    train_ds, valid_ds, test_ds = build_gpt_datasets(
        ["data/demo/corpus_text_document"], split="98,2,0", seq_length=512, seed=1234,
        tokenizer=tokenizer, num_samples=(train_samples, valid_samples, test_samples))

Each sample is a dict of torch tensors: tokens, labels (tokens shifted left by
one), loss_mask, position_ids and attention_mask.

The --data-path parsing, index checks and builder call here are shared with bert_datasets.py.
"""

import contextlib
import math
import os
import struct

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import DType
from megatron.core.datasets.utils import Split, get_blend_from_list
from parm_trainer.data.input_files import check_data_files, data_path_words, is_number
from parm_trainer.errors import DataError

PREPROCESS_HINT = "re-run tools/preprocess_data.py"


# The .idx layout: magic, version (uint64), token dtype code (uint8), sequence
# count and document count (uint64 each), then int32 sequence lengths, int64
# sequence byte offsets into the .bin, int64 document boundaries.
IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_FIXED_BYTES = len(IDX_MAGIC) + 8 + 1 + 8 + 8


def parse_data_path(data_path):
    """--data-path values -> megatron blend ([prefixes], [weights] or None).

    Accepts Megatron-LM's forms: ["prefixA", "prefixB"] or
    ["0.3", "prefixA", "0.7", "prefixB"]; an element holding several
    whitespace-separated words ("0.3 prefixA 0.7 prefixB") is split first, so
    prefixes cannot contain spaces.
    """
    words = data_path_words(data_path)
    if not words:
        raise DataError("--data-path is empty")
    if len(words) > 1 and is_number(words[0]) and len(words) % 2:
        raise DataError(f"--data-path {' '.join(words)!r}: expected 'weight prefix' pairs, "
                        f"got {len(words)} words")
    prefixes, weights = get_blend_from_list(words)
    if weights is None and len(words) % 2 == 0 and is_number(words[0]):
        raise DataError(f"--data-path {' '.join(words)!r}: expected 'weight prefix' "
                         f"pairs, but some weights are not numbers")
    if weights is not None:
        bad = [w for w in weights if not (math.isfinite(w) and w >= 0)]
        if bad or not sum(weights) > 0:
            raise DataError(f"--data-path {' '.join(words)!r}: each blend weight must be a "
                            f"finite number >= 0 and their sum positive"
                            + (f", got {bad[0]:g}" if bad else ""))
    return prefixes, weights


def check_indexed_dataset(prefix):
    """Raise a clear error unless prefix.bin/.idx look like a valid dataset; returns its
    (sequences, documents) counts (equal unless tools/preprocess_data.py --split-sentences).

    megatron.core checks the index with asserts (skipped under python -O) or
    not at all, and a truncated file otherwise surfaces as an opaque numpy or
    IndexError much later.
    """
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    check_data_files(prefix)

    def corrupt(reason):
        return DataError(f"{idx_path} is not a valid megatron indexed dataset index: "
                          f"{reason}; {PREPROCESS_HINT}")

    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        fixed = f.read(_IDX_FIXED_BYTES)
        if not fixed.startswith(IDX_MAGIC):
            raise corrupt(f"bad header magic (expected {IDX_MAGIC!r})")
        if len(fixed) < _IDX_FIXED_BYTES:
            raise corrupt(f"truncated header ({idx_size} bytes)")
        version, code, num_seqs, num_docs = struct.unpack("<QBQQ", fixed[len(IDX_MAGIC):])
        if version != 1:
            raise corrupt(f"unsupported version {version}")
        if code not in {d.value for d in DType}:
            raise corrupt(f"unknown token dtype code {code}")
        expected = _IDX_FIXED_BYTES + 12 * num_seqs + 8 * num_docs
        if idx_size < expected:
            raise corrupt(f"truncated ({idx_size} bytes, its header promises {expected})")

        def read_at(offset, fmt):
            f.seek(_IDX_FIXED_BYTES + offset)
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        docs_at = 12 * num_seqs
        if num_docs == 0 or read_at(docs_at, "<q") != 0 \
                or read_at(docs_at + 8 * (num_docs - 1), "<q") != num_seqs:
            raise corrupt("document boundaries do not cover the sequences")
        if num_seqs == 0:
            raise DataError(f"--data-path prefix {prefix} holds no documents")
        last_length = read_at(4 * (num_seqs - 1), "<i")
        last_pointer = read_at(4 * num_seqs + 8 * (num_seqs - 1), "<q")

    bin_needed = last_pointer + last_length * DType.size(code)
    bin_size = os.path.getsize(bin_path)
    if bin_size < bin_needed:
        raise DataError(f"{bin_path} is truncated ({bin_size} bytes, its index needs "
                         f"{bin_needed}); {PREPROCESS_HINT}")
    return num_seqs, num_docs - 1  # the index stores num_docs + 1 document boundaries


def split_ranges(num_elements, split_matrix, num_samples):
    """(split, begin, end) of each split samples are asked from, as megatron.core's builder
    cuts num_elements (GPT: sequences, BERT: documents) by the normalised --split."""
    for split, bookends, samples in zip(Split, split_matrix, num_samples):
        if bookends is not None and samples is not None:
            yield (split, int(round(bookends[0] * num_elements)),
                   int(round(bookends[1] * num_elements)))


def check_splits_not_empty(prefix, num_docs, split_matrix, num_samples):
    """megatron.core loops forever when asked for samples from a split that
    received no documents, so refuse that up front."""
    for split, begin, end in split_ranges(num_docs, split_matrix, num_samples):
        if end <= begin:
            raise DataError(f"{prefix} has {num_docs} documents, too few to give the "
                             f"{split.name} split any under the split {split_matrix}; "
                             f"use more data or another --split")


@contextlib.contextmanager
def _rank_zero_without_distributed():
    """Let megatron.core ask a lone process for its rank.

    BlendedDataset (megatron-core 0.16.1) calls torch.distributed.get_rank()
    on a cache miss without checking that torch.distributed is initialized,
    so blends fail in a single process. A lone process is rank 0.
    """
    if torch.distributed.is_initialized():
        yield
        return
    get_rank = torch.distributed.get_rank
    torch.distributed.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        torch.distributed.get_rank = get_rank


def common_config(data_path, split, seq_length, seed, tokenizer, data_cache_path) -> dict:
    """The BlendedMegatronDatasetConfig fields GPT and BERT datasets share."""
    return dict(random_seed=seed, sequence_length=seq_length,
                blend=parse_data_path(data_path) if data_path else None, split=split,
                tokenizer=tokenizer,
                path_to_cache=data_cache_path, mid_level_dataset_surplus=0.005)


def build_splits(dataset_class, config, num_samples):
    """(train, valid, test) of dataset_class through megatron.core's builder; with
    torch.distributed initialized every rank must call it (see build_gpt_datasets)."""
    builder = BlendedMegatronDatasetBuilder(dataset_class, list(num_samples), lambda: True, config)
    with _rank_zero_without_distributed():
        return builder.build()


def build_gpt_datasets(data_path, split, seq_length, seed, tokenizer, num_samples,
                       data_cache_path=None, mock=False):
    """Build (train, valid, test) GPTDatasets; a split with weight 0 is None.

    data_path follows Megatron-LM's --data-path (prefixes, optionally with
    weights); split is e.g. "98,2,0"; num_samples is the number of samples
    to draw per split (at least; datasets repeat in epochs to reach it).
    Sample indices are cached under data_cache_path; without one, megatron
    caches each prefix's under PREFIX/cache/GPTDataset_indices/ (a directory
    named like the prefix, next to its .bin/.idx) and blends are not cached.

    mock (--mock-data; data_path None): megatron-core's MockGPTDataset, synthetic sequences
    of the tokenizer's vocabulary, each split the same size (megatron's split 1,1,1).

    Works without torch.distributed. When it is initialized, every rank must
    call this: rank 0 builds the indices first and the others then load them
    (megatron.core synchronizes with barriers).
    """
    config = GPTDatasetConfig(
        **common_config(data_path, split, seq_length, seed, tokenizer, data_cache_path),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # causal masking happens inside the model
    )
    if mock:  # megatron-core sets config.mock itself where there is no blend
        return build_splits(MockGPTDataset, config, num_samples)
    for prefix in config.blend[0]:
        num_seqs, _ = check_indexed_dataset(prefix)
        check_splits_not_empty(prefix, num_seqs, config.split_matrix, num_samples)
    return build_splits(GPTDataset, config, num_samples)
