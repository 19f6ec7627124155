"""--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR: a tokenizer saved by transformers.

    python tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer \\
        --tokenizer-model path/to/Qwen3-30B-A3B ...

Megatron-LM's _HuggingFaceTokenizer (megatron/training/tokenizer/tokenizer.py, core_v0.16.1):
transformers' AutoTokenizer from the directory; a text's ids are what the tokenizer gives
(the special tokens its post-processor adds included, e.g. a Llama family's bos), eod is its
eos, the vocabulary size len(tokenizer). DIR is a directory (tokenizer.json or
tokenizer_config.json in it): this machine reads no hub, and neither does the check
(data/input_files.check_hf_directory).
"""

from __future__ import annotations

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

from parm_trainer.data.legacy import legacy_init
from parm_trainer.errors import TokenizerError


class HuggingFaceTokenizer(MegatronLegacyTokenizer):
    def __init__(self, directory: str):
        legacy_init(self, directory)
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as error:
            raise TokenizerError(f"--tokenizer-model {directory}: transformers cannot read its "
                                 f"tokenizer ({str(error).splitlines()[0][:200]})") from None
        if self._tokenizer.eos_token_id is None:
            raise TokenizerError(f"--tokenizer-model {directory}: the tokenizer has no eos "
                                 f"token, which Megatron-LM's HuggingFaceTokenizer uses as eod")
        self.directory = directory
        self._vocab = self._tokenizer.get_vocab()
        self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer(text).input_ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    def save(self, directory: str) -> None:
        """The tokenizer's own files (not a model's weights beside them) into directory."""
        self._tokenizer.save_pretrained(directory)

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv_vocab

    @property
    def eod(self) -> int:
        return self._tokenizer.eos_token_id

    @property
    def bos(self):
        return self._tokenizer.bos_token_id

    @property
    def pad(self):
        return self._tokenizer.pad_token_id
