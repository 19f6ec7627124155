"""SentencePiece tokenizer with the interface megatron.core's datasets expect.

    from parm_trainer.data.tokenizer import build_tokenizer
    tokenizer = build_tokenizer("SentencePieceTokenizer", "data/demo/tokenizer.model")

Models trained by tools/train_tokenizer.py reserve <pad>, <unk>, <s>, </s> and
the BERT symbols [CLS], [SEP], [MASK], so one tokenizer serves GPT and BERT.
"""

import logging
import os

import sentencepiece
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
from parm_trainer.errors import TokenizerError

BERT_SYMBOLS = ("[CLS]", "[SEP]", "[MASK]")
RETRAIN_HINT = "retrain it with tools/train_tokenizer.py"


class SentencePieceTokenizer(MegatronLegacyTokenizer):
    """Wraps a SentencePiece .model file.

    ``eod`` (the token appended after every document) is SentencePiece's eos.
    """

    def __init__(self, model_file: str):
        # The base class logs a deprecation notice pointing at
        # megatron.core.tokenizers; the datasets still accept this interface.
        base_logger = logging.getLogger(MegatronLegacyTokenizer.__module__)
        previous_level = base_logger.level
        base_logger.setLevel(logging.ERROR)
        try:
            super().__init__(model_file)
        finally:
            base_logger.setLevel(previous_level)
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


TOKENIZERS = {"SentencePieceTokenizer": SentencePieceTokenizer}




def build_tokenizer(tokenizer_type: str, tokenizer_model: str):
    """Build the tokenizer named by --tokenizer-type from --tokenizer-model."""
    if tokenizer_type not in TOKENIZERS:
        raise TokenizerError(f"unsupported --tokenizer-type {tokenizer_type!r}; "
                             f"choose from {', '.join(TOKENIZERS)}")
    if not tokenizer_model or not os.path.isfile(tokenizer_model):
        raise FileNotFoundError(f"--tokenizer-model {tokenizer_model} not found "
                                f"(train one with tools/train_tokenizer.py)")
    try:
        return TOKENIZERS[tokenizer_type](tokenizer_model)
    except (RuntimeError, OSError) as error:  # sentencepiece: "could not parse ModelProto"
        raise TokenizerError(f"--tokenizer-model {tokenizer_model} is not a SentencePiece model "
                             f"({error}); train one with tools/train_tokenizer.py") from None
