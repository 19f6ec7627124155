"""Train/valid/test BERT masked-LM datasets over sentence-level megatron.core indexed datasets.

    train_ds, valid_ds, test_ds = build_bert_datasets(
        ["data/demo/corpus_text_sentence"], split="969,30,1", seq_length=128, seed=1234,
        tokenizer=tokenizer, num_samples=(train, valid, test), binary_head=True,
        masking_probability=0.15, short_seq_probability=0.1)

The data comes from `tools/preprocess_data.py --split-sentences`: one sequence per sentence,
with the document boundaries kept in the index. megatron.core's BERTMaskedWordPieceDataset packs
consecutive sentences of one document into [CLS] A [SEP] B [SEP] (A and B swapped for half the
samples when the sentence-order head is on), masks 15% of the tokens (80% [MASK], 10% a random
token, 10% unchanged; n-grams of up to 3 tokens) and gives each sample as a dict of numpy
arrays: text, types (segment A 0, B 1), labels, is_random (the sentence-order target),
padding_mask, loss_mask, truncated.

SentencePiece pieces carry no WordPiece "##" continuation mark, so every piece is its own
masking candidate (megatron's whole-word masking has no word boundaries to use).
"""

from __future__ import annotations

import numpy
from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset

from parm_trainer.data.gpt_datasets import (
    DataError,
    build_splits,
    check_indexed_dataset,
    check_splits_not_empty,
    common_config,
    split_ranges,
)

# megatron.core's helpers.cpp (build_mapping) skips a document holding a longer sentence.
LONG_SENTENCE_TOKENS = 512
SPLIT_HINT = "run tools/preprocess_data.py with --split-sentences"


def check_bert_tokenizer(tokenizer) -> None:
    """BERT samples need [CLS], [SEP], [MASK] and a pad id: this project's SentencePiece
    models have them; Megatron-LM's Llama2, GPT-2 BPE and null tokenizers have none."""
    kind = type(tokenizer).__name__
    if kind != "SentencePieceTokenizer":
        raise DataError(f"--tokenizer-type {kind} has no [CLS], [SEP] and [MASK] tokens; "
                        f"pretrain_bert_moe.py needs --tokenizer-type SentencePieceTokenizer "
                        f"with a model from tools/train_tokenizer.py")
    missing = tokenizer.missing_bert_tokens()
    if missing:
        raise DataError(f"--tokenizer-model {tokenizer.model_file} lacks the special tokens "
                        f"BERT needs ({', '.join(missing)}); retrain it with "
                        f"tools/train_tokenizer.py, which adds them")


def check_sentence_level(prefix: str) -> int:
    """Refuse a document-level dataset (every document one sequence); returns the documents."""
    num_seqs, num_docs = check_indexed_dataset(prefix)
    if num_seqs == num_docs:
        raise DataError(f"--data-path {prefix} is a document-level dataset (each of its "
                        f"{num_docs} documents is one sequence); BERT needs a sentence-level "
                        f"one: {SPLIT_HINT} (it writes PREFIX_text_sentence)")
    return num_docs


def usable_documents(prefix: str, min_sentences: int) -> numpy.ndarray:
    """Per document: can megatron's build_mapping draw samples from it? It needs at least
    min_sentences sentences and skips a multi-sentence document with a sentence over 512
    tokens."""
    index = IndexedDataset(prefix)
    bounds = index.document_indices
    sentences = numpy.diff(bounds)
    long = numpy.concatenate([[0], numpy.cumsum(index.sequence_lengths > LONG_SENTENCE_TOKENS)])
    has_long = (long[bounds[1:]] - long[bounds[:-1]]) > 0
    return (sentences >= min_sentences) & ((sentences <= 1) | ~has_long)


def _check_splits_usable(prefix, num_docs, split_matrix, num_samples, min_sentences):
    """megatron.core would loop (over 2^31 epochs) looking for samples in a split whose
    documents are all unusable, so refuse that up front."""
    usable = usable_documents(prefix, min_sentences)
    for split, begin, end in split_ranges(num_docs, split_matrix, num_samples):
        if not usable[begin:end].any():
            raise DataError(
                f"{prefix}: none of the {end - begin} documents of the {split.name} split has "
                f"{min_sentences} or more sentences of at most {LONG_SENTENCE_TOKENS} tokens "
                f"(sentence-order pairs need two); use more data, another --split, or "
                f"{SPLIT_HINT}")


def build_bert_datasets(data_path, split, seq_length, seed, tokenizer, num_samples,
                        binary_head=True, masking_probability=0.15, short_seq_probability=0.1,
                        data_cache_path=None):
    """Build (train, valid, test) BERTMaskedWordPieceDatasets; a split with weight 0 is None.

    Arguments as build_gpt_datasets; binary_head: build sentence-order pairs (documents need
    two sentences). Indices are cached like the GPT ones. With torch.distributed initialized,
    every rank must call this.
    """
    check_bert_tokenizer(tokenizer)
    config = BERTMaskedWordPieceDatasetConfig(
        **common_config(data_path, split, seq_length, seed, tokenizer, data_cache_path),
        masking_probability=masking_probability,
        short_sequence_probability=short_seq_probability,
        masking_max_ngram=3,
        masking_do_full_word=False,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=binary_head,
    )
    for prefix in config.blend[0]:
        num_docs = check_sentence_level(prefix)
        check_splits_not_empty(prefix, num_docs, config.split_matrix, num_samples)
        _check_splits_usable(prefix, num_docs, config.split_matrix, num_samples,
                             2 if binary_head else 1)
    return build_splits(BERTMaskedWordPieceDataset, config, num_samples)
