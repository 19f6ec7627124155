"""The project's SentencePiece tokenizer as a Hugging Face fast tokenizer with the same ids.

tools/train_tokenizer.py trains BPE models with byte fallback, no dummy prefix, no whitespace
normalisation and split digits. Such a model is expressed exactly by a `tokenizers` BPE whose
merges follow the piece order (SentencePiece merges higher-scored pieces first, and its pieces
are stored by score), with " " written as "▁" and bytes falling back to <0xNN> pieces. Control
pieces (<s>, </s>, <pad>) never match text in SentencePiece, so they are special tokens that
are split in text (`split_special_tokens`); user-defined pieces ([CLS], [SEP], [MASK]) do
match text in both.
"""

from __future__ import annotations

import json
import os

from sentencepiece import sentencepiece_model_pb2

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


class TokenizerNotExportable(ValueError):
    """A SentencePiece model whose behaviour the exported tokenizer would not reproduce."""


def _proto(model_file: str):
    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def _check_exportable(proto, model_file: str) -> None:
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if spec.model_type != 2:
        problems.append("it is not a BPE model")
    if norm.add_dummy_prefix or norm.remove_extra_whitespaces or norm.precompiled_charsmap:
        problems.append("it normalises text (dummy prefix, whitespace or a charsmap)")
    if problems:
        raise TokenizerNotExportable(
            f"tokenizer {model_file}: {' and '.join(problems)}; train it with "
            f"tools/train_tokenizer.py --model-type bpe to export it")


def _merges(proto, vocab: dict) -> list:
    """Each normal piece's splits into two vocabulary pieces, in piece order."""
    merges = []
    for piece in proto.pieces:
        if piece.type != NORMAL:
            continue
        text = piece.piece
        local = [(text[:k], text[k:]) for k in range(1, len(text))
                 if text[:k] in vocab and text[k:] in vocab]
        merges.extend(sorted(local, key=lambda lr: (vocab[lr[0]], vocab[lr[1]])))
    return merges


def save_hf_tokenizer(model_file: str, out_dir: str) -> None:
    """Write tokenizer.json and tokenizer_config.json (AutoTokenizer reads them)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    proto = _proto(model_file)
    _check_exportable(proto, model_file)
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    spec = proto.trainer_spec
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=_merges(proto, vocab),
                              unk_token=spec.unk_piece, fuse_unk=True,
                              byte_fallback=spec.byte_fallback))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_tokens([AddedToken(p.piece, normalized=False, special=False)
                          for p in proto.pieces if p.type == USER_DEFINED])

    def piece(index: int):
        return proto.pieces[index].piece if 0 <= index < len(proto.pieces) else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=piece(spec.bos_id), eos_token=piece(spec.eos_id),
        unk_token=piece(spec.unk_id), pad_token=piece(spec.pad_id), split_special_tokens=True)
    fast.save_pretrained(out_dir)
    # transformers 4.x knows the fast tokenizer by this name (5.x by either)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    config = json.load(open(config_path))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
