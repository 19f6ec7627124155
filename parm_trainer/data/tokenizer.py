"""The tokenizers --tokenizer-type names, with the interface megatron.core's datasets expect.

    from parm_trainer.data.tokenizer import build_tokenizer, tokenizer_from_args
    tokenizer = build_tokenizer("SentencePieceTokenizer", "data/demo/tokenizer.model")
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file="vocab.json",
                                merge_file="merges.txt")
    tokenizer = tokenizer_from_args(args)  # --tokenizer-type and the flags it reads

Types and flags are Megatron-LM's (megatron/training/tokenizer/tokenizer.py):

    SentencePieceTokenizer  --tokenizer-model  this project's: plain SentencePiece ids, eod =
                            eos. Models trained by tools/train_tokenizer.py reserve <pad>,
                            <unk>, <s>, </s> and the BERT symbols [CLS], [SEP], [MASK], so one
                            tokenizer serves GPT and BERT.
    Llama2Tokenizer         --tokenizer-model  Megatron-LM's: bos before every text, eod = eos
    GPT2BPETokenizer        --vocab-file --merge-file  byte-level BPE, eod = <|endoftext|>
    NullTokenizer           --vocab-size  text is space-separated ids, eod = --vocab-size
    HuggingFaceTokenizer    --tokenizer-model DIR  transformers' tokenizer saved in DIR
                            (tokenizer.json), eod = its eos (hf_tokenizer.py)

input_files.check_tokenizer_flags says, in one line, what a type lacks (a flag, a file that
exists and is readable); build_tokenizer also says what a file holds that the type cannot read.
"""

import json

import sentencepiece
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
from parm_trainer.data.hf_tokenizer import HuggingFaceTokenizer
from parm_trainer.data.input_files import check_tokenizer_flags
from parm_trainer.data.legacy import legacy_init as _legacy_init
from parm_trainer.errors import TokenizerError

BERT_SYMBOLS = ("[CLS]", "[SEP]", "[MASK]")
RETRAIN_HINT = "retrain it with tools/train_tokenizer.py"
GPT2_EOD = "<|endoftext|>"


class SentencePieceTokenizer(MegatronLegacyTokenizer):
    """Wraps a SentencePiece .model file.

    ``eod`` (the token appended after every document) is SentencePiece's eos.
    """

    def __init__(self, model_file: str):
        _legacy_init(self, model_file)
        self.model_file = model_file
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._vocab = None
        self._inv_vocab = None

    # Re-open the model after pickling (e.g. DataLoader workers with spawn).
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_sp"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=self.model_file)

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def vocab(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {i: piece for piece, i in self.vocab.items()}
        return self._inv_vocab

    def _special_id(self, value: int, name: str) -> int:
        if value < 0:
            raise ValueError(f"tokenizer {self.model_file} has no {name} token; {RETRAIN_HINT}")
        return value

    @property
    def eod(self) -> int:
        return self._special_id(self._sp.eos_id(), "eos")

    @property
    def eos(self) -> int:
        return self._special_id(self._sp.eos_id(), "eos")

    @property
    def bos(self) -> int:
        return self._special_id(self._sp.bos_id(), "bos")

    @property
    def pad(self) -> int:
        return self._special_id(self._sp.pad_id(), "pad")

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    def _symbol_id(self, symbol: str):
        """Id of a user-defined symbol, or None if the model lacks it."""
        i = self._sp.piece_to_id(symbol)
        return None if self._sp.is_unknown(i) else i  # unknown pieces map to <unk>

    @property
    def has_bert_special_tokens(self) -> bool:
        return all(self._symbol_id(s) is not None for s in BERT_SYMBOLS)

    def missing_bert_tokens(self) -> list[str]:
        """The special tokens BERT samples need ([CLS], [SEP], [MASK] and a pad) that this
        model lacks; empty for models from tools/train_tokenizer.py."""
        missing = [s for s in BERT_SYMBOLS if self._symbol_id(s) is None]
        return missing + (["<pad>"] if self._sp.pad_id() < 0 else [])

    def _bert_symbol(self, symbol: str) -> int:
        i = self._symbol_id(symbol)
        if i is None:
            raise ValueError(
                f"tokenizer {self.model_file} was trained without BERT special tokens "
                f"({', '.join(BERT_SYMBOLS)}); {RETRAIN_HINT}")
        return i

    @property
    def cls(self) -> int:
        return self._bert_symbol("[CLS]")

    @property
    def sep(self) -> int:
        return self._bert_symbol("[SEP]")

    @property
    def mask(self) -> int:
        return self._bert_symbol("[MASK]")


class _NoBertSymbols:
    """cls, sep and mask of a tokenizer without BERT's symbols: -1, as Megatron-LM's."""

    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1


class Llama2Tokenizer(_NoBertSymbols, SentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer on a SentencePiece model: every text starts with bos (the
    default of its tokenize, for text completion), eod is eos, and it has no BERT symbols
    (cls, sep and mask are -1 there)."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self._sp.bos_id() < 0 or self._sp.eos_id() < 0:  # -1 would be written as an id
            raise TokenizerError(f"--tokenizer-model {model_file} has no bos or no eos piece, "
                                 f"which Llama2Tokenizer puts around texts")

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self._sp.encode(text)
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])


def _read_gpt2_vocab(vocab_file: str) -> dict:
    """vocab.json as Megatron-LM reads it: a JSON object of token -> id. Its ids must be
    0..N-1 (the embedding has len(vocab) rows) and it must hold <|endoftext|> (eod)."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise TokenizerError(f"--vocab-file {vocab_file} is not a GPT-2 BPE vocabulary (JSON of "
                             f"token: id): {error}") from None
    ids = list(vocab.values()) if isinstance(vocab, dict) else None
    if ids is None or not all(type(i) is int for i in ids) or \
            sorted(ids) != list(range(len(ids))):
        raise TokenizerError(f"--vocab-file {vocab_file} is not a GPT-2 BPE vocabulary: it must "
                             f"map every token to one of the ids 0..N-1, each once")
    if GPT2_EOD not in vocab:
        raise TokenizerError(f"--vocab-file {vocab_file} has no {GPT2_EOD} token "
                             f"(GPT2BPETokenizer's end of document)")
    return vocab


def _read_gpt2_merges(merge_file: str, vocab: dict, vocab_file: str) -> list:
    """merges.txt as Megatron-LM reads it: the first line (the '#version' header) and the part
    after the last newline are skipped, each other line is one merge 'a b'. Every merge must
    join two tokens of the vocabulary into a third (tokenizers would panic on one that
    does not)."""
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")[1:-1]
    except UnicodeDecodeError as error:
        raise TokenizerError(f"--merge-file {merge_file} is not UTF-8 text ({error.reason})") \
            from None
    merges = [tuple(line.split()) for line in lines]
    for number, merge in enumerate(merges, start=2):
        if len(merge) == 2 and not all(part in vocab for part in (*merge, "".join(merge))):
            raise TokenizerError(f"--merge-file {merge_file} line {number} joins {merge[0]!r} "
                                 f"and {merge[1]!r}, which --vocab-file {vocab_file} does not "
                                 f"hold with their join")
    return [merge for merge in merges if len(merge) == 2]  # Megatron-LM never matches others


class GPT2BPETokenizer(MegatronLegacyTokenizer):
    """Megatron-LM's GPT2BPETokenizer: OpenAI's byte-level BPE from vocab.json and merges.txt,
    run by the `tokenizers` library. Text is split by GPT-2's pattern with no space added in
    front, every UTF-8 byte is a symbol, and merges apply in file order; a token missing from
    the vocabulary is id 0, as in Megatron-LM. <|endoftext|> is eod; written in a text it is
    ordinary characters (Megatron-LM has no special tokens here). It has no pad, bos or eos."""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        _legacy_init(self, vocab_file, merge_file)
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self._vocab = _read_gpt2_vocab(vocab_file)
        self._inv_vocab = {i: token for token, i in self._vocab.items()}
        merges = _read_gpt2_merges(merge_file, self._vocab, vocab_file)
        self._bpe = Tokenizer(models.BPE(vocab=self._vocab, merges=merges,
                                         unk_token=self._inv_vocab[0]))
        self._bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._bpe.decoder = decoders.ByteLevel()

    def tokenize(self, text: str) -> list[int]:
        return self._bpe.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._bpe.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    @property
    def eod(self) -> int:
        return self._vocab[GPT2_EOD]


class NullTokenizer(_NoBertSymbols, MegatronLegacyTokenizer):
    """Megatron-LM's NullTokenizer: a text is its token ids separated by single spaces, ids
    0..vocab_size-1 are the data's and vocab_size itself is eod (vocab_size + 1 ids in all)."""

    def __init__(self, vocab_size: int):
        _legacy_init(self, None, vocab_size=vocab_size)
        self._size_without_eod = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(word) for word in text.split(" ")]
        except ValueError:
            raise TokenizerError(f"--tokenizer-type NullTokenizer reads token ids separated by "
                                 f"single spaces, got {text[:60]!r}") from None

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab_size(self) -> int:
        return self._size_without_eod + 1

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary")

    @property
    def inv_vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary")

    @property
    def eod(self) -> int:
        return self._size_without_eod


TOKENIZERS = {"SentencePieceTokenizer": SentencePieceTokenizer,
              "Llama2Tokenizer": Llama2Tokenizer,
              "GPT2BPETokenizer": GPT2BPETokenizer,
              "NullTokenizer": NullTokenizer,
              "HuggingFaceTokenizer": HuggingFaceTokenizer}


def tokenizer_from_args(args):
    """The tokenizer --tokenizer-type names, from the flags it reads (checked first)."""
    check_tokenizer_flags(args)
    kind = args.tokenizer_type
    if kind == "NullTokenizer":
        return NullTokenizer(args.vocab_size)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(args.tokenizer_model)
    try:
        return TOKENIZERS[kind](args.tokenizer_model)
    except (RuntimeError, OSError) as error:  # sentencepiece: "could not parse ModelProto"
        raise TokenizerError(f"--tokenizer-model {args.tokenizer_model} is not a SentencePiece "
                             f"model ({error}); train one with tools/train_tokenizer.py") \
            from None


def build_tokenizer(tokenizer_type: str, tokenizer_model: str = None, *, vocab_file: str = None,
                    merge_file: str = None, vocab_size: int = None):
    """The tokenizer --tokenizer-type names, from the flags' values."""
    from types import SimpleNamespace

    return tokenizer_from_args(SimpleNamespace(
        tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model, vocab_file=vocab_file,
        merge_file=merge_file, vocab_size=vocab_size))
