"""BERT with MoE layers on megatron-core's BertModel, built from the same layer specs as GPT.

megatron-core has no MoE spec for BERT. A BERT layer is a GPT layer (local spec) whose
self-attention takes a padding mask instead of the causal one, so the block spec is GPT's
(MoE every --moe-layer-freq layers, run through ParmMoELayer unless --moe-parm-schedule
megatron) with the attention mask type switched. The rest is megatron's BertModel: embeddings
with token types, the encoder block, the masked-LM head and the binary (sentence-order) head.
"""

from __future__ import annotations

import argparse
from typing import Optional

from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from parm_trainer.models.gpt import gpt_layer_spec, language_model_kwargs


def bert_layer_spec(config: TransformerConfig, args: argparse.Namespace,
                    vp_stage: Optional[int] = None):
    """GPT's spec (one layer, or a block with MoE layers) with bidirectional, padded attention."""
    spec = gpt_layer_spec(config, args, vp_stage)
    layers = spec.layer_specs if isinstance(spec, TransformerBlockSubmodules) else [spec]
    for layer in layers:
        attention: ModuleSpec = layer.submodules.self_attention
        attention.params = {**(attention.params or {}), "attn_mask_type": AttnMaskType.padding}
    return spec


class MoEBertModel(BertModel):
    """BertModel that accepts a block spec (a list of layer specs, MoE and dense)."""

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        # BertModel reads the attention backend from a single layer spec, which a block spec
        # does not have: its answer for the first layer holds for all (one spec builds them):
        # [b, 1, s, s] for megatron's local attention, Transformer Engine's per its version.
        block = self.transformer_layer_spec
        if not isinstance(block, TransformerBlockSubmodules):
            return super()._sanity_check_attention_and_get_attn_mask_dimension()
        self.transformer_layer_spec = block.layer_specs[0]
        try:
            return super()._sanity_check_attention_and_get_attn_mask_dimension()
        finally:
            self.transformer_layer_spec = block


def build_bert_moe(args: argparse.Namespace, config: TransformerConfig, vocab_size: int,
                   pre_process: bool = True, post_process: bool = True,
                   vp_stage: Optional[int] = None) -> BertModel:
    return MoEBertModel(
        transformer_layer_spec=bert_layer_spec(config, args, vp_stage),
        # token types (segment A/B) exist only for the sentence-order pairs, as in Megatron-LM
        num_tokentypes=2 if args.bert_binary_head else 0,
        add_binary_head=args.bert_binary_head,
        **language_model_kwargs(args, config, vocab_size, pre_process, post_process, vp_stage))
