"""megatron-core's legacy tokenizer interface, which its datasets read, set up quietly."""

from __future__ import annotations

import logging

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer


def legacy_init(tokenizer, *paths, **options) -> None:
    """MegatronLegacyTokenizer.__init__ (it records the paths for the datasets' cache keys)
    without its deprecation notice pointing at megatron.core.tokenizers: the datasets still
    accept this interface."""
    base_logger = logging.getLogger(MegatronLegacyTokenizer.__module__)
    previous_level = base_logger.level
    base_logger.setLevel(logging.ERROR)
    try:
        MegatronLegacyTokenizer.__init__(tokenizer, *paths, **options)
    finally:
        base_logger.setLevel(previous_level)
