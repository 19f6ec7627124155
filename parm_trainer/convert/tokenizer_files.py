"""The tokenizer a conversion carries: chosen on import, written beside the weights on export.

Import (--loader hf) reads one of two kinds:
- SentencePieceTokenizer: a tokenizer.model file; the directory's own, or --tokenizer-model
  FILE. A directory that holds tokenizer.model is read so even when it also holds
  tokenizer.json (transformers saves both for a SentencePiece model, and this project's exports
  hold both), unless --tokenizer-type HuggingFaceTokenizer is given;
- HuggingFaceTokenizer (Megatron-LM's): a directory with tokenizer.json, as transformers saves
  it; the model directory when it has tokenizer.json and no tokenizer.model, or
  --tokenizer-model DIR.
The checkpoint carries the tokenizer (a copy of tokenizer.model, or the tokenizer's own files
in hf_tokenizer/), and its run.json names the kind. The tokenizer's size must fit the model:
size <= config.json's vocab_size <= the size padded for tensor parallelism (which training
computes from the tokenizer, so the checkpoint's embedding rows match).

Export (--saver hf): a SentencePiece model as tokenizer.json (hf_tokenizer.py) beside the
model file; a HuggingFaceTokenizer's own files as the checkpoint carries them. bos, eos and
pad are the tokenizer's.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Optional

from parm_trainer.convert.output import ConvertError

SENTENCEPIECE, HUGGING_FACE = "SentencePieceTokenizer", "HuggingFaceTokenizer"
KINDS = (SENTENCEPIECE, HUGGING_FACE)
TOKENIZER_JSON = "tokenizer.json"


class TokenizerChoiceError(ConvertError):
    """A tokenizer a conversion cannot carry; the message names it."""


@dataclass
class Tokenizer:
    kind: str
    path: str  # the SentencePiece file, or the HuggingFaceTokenizer directory
    size: int
    bos: Optional[int]
    eos: Optional[int]
    pad: Optional[int]
    loaded: object = None  # parm_trainer.data's tokenizer (a checkpoint's copy is saved from it)


def _sentencepiece(path: str) -> Tokenizer:
    import sentencepiece

    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as error:  # "could not parse ModelProto"
        raise TokenizerChoiceError(f"--tokenizer-model {path} is not a SentencePiece model "
                                   f"({error})") from None
    return Tokenizer(SENTENCEPIECE, path, sp.vocab_size(), sp.bos_id(), sp.eos_id(),
                     max(sp.pad_id(), 0))


def _hugging_face(directory: str) -> Tokenizer:
    if not os.path.isfile(os.path.join(directory, TOKENIZER_JSON)):
        raise TokenizerChoiceError(
            f"{directory} holds no {TOKENIZER_JSON}: HuggingFaceTokenizer converts a fast "
            f"tokenizer as transformers saves it (tokenizer.save_pretrained)")
    from parm_trainer.data.hf_tokenizer import HuggingFaceTokenizer
    from parm_trainer.errors import TokenizerError

    try:
        loaded = HuggingFaceTokenizer(directory)
    except TokenizerError as error:
        raise TokenizerChoiceError(str(error)) from None
    return Tokenizer(HUGGING_FACE, directory, loaded.vocab_size, loaded.bos, loaded.eod,
                     loaded.pad, loaded)


def choose(load_dir: str, tokenizer_model: Optional[str], kind: Optional[str]) -> Tokenizer:
    """The tokenizer an import carries (see the module's docstring for the rule)."""
    own_model = os.path.join(load_dir, "tokenizer.model")
    if tokenizer_model is not None:
        if kind is None:
            kind = HUGGING_FACE if os.path.isdir(tokenizer_model) else SENTENCEPIECE
        if not os.path.exists(tokenizer_model):
            raise TokenizerChoiceError(f"--tokenizer-model {tokenizer_model}: no such file or "
                                       f"directory")
        path = tokenizer_model
    elif kind == HUGGING_FACE:
        path = load_dir
    elif kind == SENTENCEPIECE or os.path.isfile(own_model):
        if not os.path.isfile(own_model):
            raise TokenizerChoiceError(f"{load_dir} has no tokenizer.model (SentencePiece): give "
                                       f"--tokenizer-model")
        kind, path = SENTENCEPIECE, own_model
    elif os.path.isfile(os.path.join(load_dir, TOKENIZER_JSON)):
        kind, path = HUGGING_FACE, load_dir
    else:
        raise TokenizerChoiceError(
            f"{load_dir} has no tokenizer.model (SentencePiece) nor {TOKENIZER_JSON} (Hugging "
            f"Face): give --tokenizer-model")
    if kind == SENTENCEPIECE and os.path.isdir(path):
        raise TokenizerChoiceError(f"--tokenizer-model {path} is a directory: give its "
                                   f"tokenizer.model, or --tokenizer-type {HUGGING_FACE}")
    return _hugging_face(path) if kind == HUGGING_FACE else _sentencepiece(path)


def padded_rows(tokenizer: Tokenizer, embedding_rows: int) -> tuple:
    """(the checkpoint's embedding rows, --make-vocab-size-divisible-by that gives training
    those rows): the tokenizer's size padded as training pads it (to 128), or, where
    config.json has more rows than that (Qwen3's 151,936 for 151,665 tokens), the rows
    themselves, as the multiple to pad to (under TP t training pads to lcm(rows, t): the same
    rows wherever t divides them). Refuses a tokenizer larger than the embedding."""
    from parm_trainer.models.config import padded_vocab_size

    if tokenizer.size > embedding_rows:
        raise TokenizerChoiceError(
            f"the tokenizer {tokenizer.path} has {tokenizer.size} tokens, more than the model's "
            f"{embedding_rows} embedding rows (config.json vocab_size): its ids past "
            f"{embedding_rows - 1} would have no embedding")
    padded = padded_vocab_size(tokenizer.size, 1)
    if embedding_rows > padded:
        return embedding_rows, embedding_rows
    return padded, 128


def exported_kind(args: dict, load_dir: str) -> str:
    """The kind of tokenizer a checkpoint's run.json names, refused where no export carries it
    (before anything is read)."""
    kind = args.get("tokenizer_type") or SENTENCEPIECE
    if kind == "Llama2Tokenizer":
        kind = SENTENCEPIECE
    if kind not in KINDS:
        raise TokenizerChoiceError(
            f"--load-dir {load_dir} was trained with --tokenizer-type {kind}; the Hugging Face "
            f"export carries SentencePiece and HuggingFaceTokenizer tokenizers only")
    return kind


def of_checkpoint(path: str, args: dict) -> Tokenizer:
    """The tokenizer a checkpoint's run.json names, read from the copy it carries."""
    from parm_trainer.training.checkpoint.files import tokenizer_copy

    kind = exported_kind(args, os.path.dirname(path))
    copy = os.path.join(path, tokenizer_copy(args.get("tokenizer_type"), "tokenizer_model"))
    return _hugging_face(copy) if kind == HUGGING_FACE else _sentencepiece(copy)


def export(tokenizer: Tokenizer, out: str) -> None:
    """The tokenizer's files into the Hugging Face directory out."""
    if tokenizer.kind == HUGGING_FACE:
        for name in sorted(os.listdir(tokenizer.path)):
            if os.path.isfile(os.path.join(tokenizer.path, name)) and name not in (
                    "config.json", "generation_config.json"):  # the model's, written apart
                shutil.copyfile(os.path.join(tokenizer.path, name), os.path.join(out, name))
        return
    from parm_trainer.convert.hf_tokenizer import save_hf_tokenizer

    save_hf_tokenizer(tokenizer.path, out)
    shutil.copyfile(tokenizer.path, os.path.join(out, "tokenizer.model"))  # for the way back
