"""The files a run reads, checked before torch is imported: the tokenizer's (check_tokenizer_flags)
and the data set's (check_data_files), both in check_inputs with the directories a run writes.

The entry points run check_inputs first (training/user_errors.check_flags_first), so a mistyped
path ends every rank in a fraction of a second; initialize() runs it again, then reads the data
set's index through megatron-core (data/gpt_datasets.check_indexed_dataset). Imports nothing
heavier than the standard library and the project's error types.
"""

from __future__ import annotations

import os

from parm_trainer.errors import InputError, TokenizerError

# The file flags (argparse dests) each --tokenizer-type reads (data/tokenizer.py builds them); a
# checkpoint carries copies of them (training/checkpoint/files.py TOKENIZER_FILES names the
# copies).
TOKENIZER_FILE_FLAGS = {"SentencePieceTokenizer": ("tokenizer_model",),
                        "Llama2Tokenizer": ("tokenizer_model",),
                        "GPT2BPETokenizer": ("vocab_file", "merge_file"),
                        "NullTokenizer": (),
                        "HuggingFaceTokenizer": ("tokenizer_model",)}  # a directory
_TRAIN_HINTS = {"tokenizer_model": " (train one with tools/train_tokenizer.py; for GPT-2 BPE "
                                   "give --vocab-file and --merge-file)"}
# what a directory saved by transformers holds for its tokenizer (either will do)
HF_MARKERS = ("tokenizer.json", "tokenizer_config.json")


def check_inputs(args) -> None:
    """--data-path or --mock-data, the tokenizer's files, the data set's files, the directories
    a run writes: the first problem as one InputError line (or FileNotFoundError, a missing data
    file)."""
    if args.mock_data and args.data_path:
        raise InputError("--mock-data trains on synthetic data: leave out --data-path, or "
                         "--mock-data to train on it")
    if not args.data_path and not args.mock_data:
        raise InputError("--data-path is required (an indexed dataset prefix, "
                         "e.g. data/demo/corpus_text_document), or --mock-data")
    check_tokenizer_flags(args)  # the type's flags and files
    for prefix in named_prefixes(args.data_path or []):
        check_data_files(prefix)
    for flag in ("load", "save", "tensorboard_dir", "data_cache_path", "wandb_save_dir"):
        path = getattr(args, flag)
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise InputError(f"--{flag.replace('_', '-')} {path} is not a directory")


def named_prefixes(data_path) -> list:
    """The words of --data-path that are not numbers: its prefixes, in both of Megatron-LM's
    forms (prefixes, or weight-prefix pairs). A prefix that is itself a number is left to
    gpt_datasets.parse_data_path, which reads the blend as megatron-core does."""
    return [word for word in data_path_words(data_path) if not is_number(word)]


def data_path_words(data_path) -> list:
    """--data-path's words: its values, each split at whitespace ("0.3 a 0.7 b" is four)."""
    items = [data_path] if isinstance(data_path, str) else data_path
    return [word for item in items for word in item.split()]


def check_data_files(prefix: str) -> None:
    for path in (prefix + ".bin", prefix + ".idx"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--data-path prefix {prefix}: {path} not found "
                                    f"(create it with tools/preprocess_data.py)")


def is_number(word: str) -> bool:
    """Whether a --data-path word is a blend weight's number."""
    try:
        float(word)
        return True
    except ValueError:
        return False


def check_tokenizer_flags(args) -> None:
    """The tokenizer flags, before anything is built or any process group starts: a type this
    project has, the flags it reads given, their files present and readable. One InputError
    or TokenizerError line naming the flag."""
    kind = args.tokenizer_type
    if kind not in TOKENIZER_FILE_FLAGS:
        raise TokenizerError(f"unsupported --tokenizer-type {kind!r}; choose from "
                             f"{', '.join(TOKENIZER_FILE_FLAGS)}")
    if kind == "NullTokenizer" and getattr(args, "vocab_size", None) is None:
        raise InputError("--vocab-size is required with --tokenizer-type NullTokenizer (the "
                         "number of token ids before its eod)")
    if kind == "HuggingFaceTokenizer":
        check_hf_directory(args.tokenizer_model)
        return
    for dest in TOKENIZER_FILE_FLAGS[kind]:
        _check_file(dest, getattr(args, dest, None), kind)


def check_hf_directory(path) -> None:
    """--tokenizer-model for HuggingFaceTokenizer: a readable directory saved by transformers."""
    if not path:
        raise InputError("--tokenizer-model is required with --tokenizer-type "
                         "HuggingFaceTokenizer (a directory saved by transformers, with "
                         "tokenizer.json)")
    if not os.path.isdir(path):
        raise InputError(f"--tokenizer-model {path}: not a directory (HuggingFaceTokenizer reads "
                         f"a directory saved by transformers: tokenizer.json, "
                         f"tokenizer_config.json; a hub name must be downloaded first)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in HF_MARKERS):
        raise InputError(f"--tokenizer-model {path} holds no tokenizer.json nor "
                         f"tokenizer_config.json (save one with tokenizer.save_pretrained)")


def _check_file(dest: str, path, kind: str) -> None:
    flag = "--" + dest.replace("_", "-")
    if not path:
        raise InputError(f"{flag} is required with --tokenizer-type {kind}"
                         f"{_TRAIN_HINTS.get(dest, '')}")
    if not os.path.exists(path):
        raise InputError(f"{flag} {path}: no such file")
    if not os.path.isfile(path):
        raise InputError(f"{flag} {path} is not a file")
    if not os.access(path, os.R_OK):
        raise InputError(f"{flag} {path} cannot be read (permission denied)")
