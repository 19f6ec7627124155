"""GPT with MoE layers on megatron-core's GPTModel, built from layer specs."""

from __future__ import annotations

import argparse

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def gpt_layer_spec(config: TransformerConfig, args: argparse.Namespace):
    """Local (no Transformer Engine) spec; MoE layers every --moe-layer-freq layers."""
    if config.num_moe_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=args.normalization)
    return get_gpt_layer_local_spec(normalization=args.normalization)


def build_gpt_moe(args: argparse.Namespace, config: TransformerConfig, vocab_size: int,
                  pre_process: bool = True, post_process: bool = True) -> GPTModel:
    return GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(config, args),
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
