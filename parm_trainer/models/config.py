"""Flags -> megatron-core TransformerConfig, shared by the GPT-MoE and BERT-MoE models."""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from parm_trainer import mla_flags, moe_flags, mtp_flags
from parm_trainer.layer_pattern import moe_layer_pattern


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    """megatron-core's config of the flags: an MLATransformerConfig with
    --multi-latent-attention (as Megatron-LM's core_transformer_config_from_args)."""
    on_gpu = torch.cuda.is_available()
    moe = {}
    if args.num_experts:
        moe = dict(
            num_moe_experts=args.num_experts,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_router_topk=args.moe_router_topk,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_layer_freq=args.moe_layer_freq,
            moe_expert_capacity_factor=args.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
            moe_token_drop_policy=args.moe_token_drop_policy,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_z_loss_coeff=args.moe_z_loss_coeff,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
            **moe_flags.config_fields(args),
        )
    mla = mla_flags.config_fields(args)
    return (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        layernorm_epsilon=args.norm_epsilon,
        ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=getattr(args, "add_qkv_bias", False),
        # the norms across heads are the spec's own modules (qk_norm.py says why not here)
        qk_layernorm=(getattr(args, "qk_layernorm", False)
                      and not getattr(args, "qk_layernorm_across_heads", False)),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        **pipeline_fields(args),
        **recompute_fields(args),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype,
        # Per-micro-batch mean loss (Megatron-LM's default). megatron-core 0.16's per-token mode
        # scales the router's aux loss by the *local* token count under sequence parallelism
        # (router.py attach_and_log_load_balancing_loss) while normalising it by the global one,
        # which weakens the aux-loss gradient by the MP size; the mean mode is layout-free.
        calculate_per_token_loss=False,
        # Weights are built on the CPU and then overwritten by models.init, layout-free.
        use_cpu_initialization=True,
        # Fused CUDA kernels (Apex/TE) are optional; the torch paths run everywhere.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=on_gpu,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **mla,
        **moe,
        **mtp_flags.config_fields(args),
    )


def pipeline_fields(args) -> dict:
    """The stage flags as Megatron-LM hands them to megatron-core (argument_utils.py): the
    layout string as given, the uneven end stages, V, and the interleaved schedule's
    overlapped point-to-point transfers (batched ones elsewhere, as before)."""
    virtual = getattr(args, "virtual_pipeline_model_parallel_size", None)
    overlap = bool(virtual) and getattr(args, "overlap_p2p_comm", True)
    return dict(pipeline_model_parallel_layout=getattr(args, "pipeline_model_parallel_layout",
                                                       None),
                num_layers_in_first_pipeline_stage=getattr(
                    args, "decoder_first_pipeline_num_layers", None),
                num_layers_in_last_pipeline_stage=getattr(
                    args, "decoder_last_pipeline_num_layers", None),
                virtual_pipeline_model_parallel_size=virtual,
                overlap_p2p_comm=overlap, batch_p2p_comm=not overlap)


def recompute_fields(args) -> dict:
    """--recompute-* as megatron-core's fields of the same names (the modules already hold
    --moe-layer-recompute's moe: arguments/recompute.settle)."""
    granularity = getattr(args, "recompute_granularity", None)
    return dict(recompute_granularity=granularity,
                recompute_method=getattr(args, "recompute_method", None),
                recompute_num_layers=getattr(args, "recompute_num_layers", None),
                recompute_modules=list(getattr(args, "recompute_modules", None) or ["core_attn"]))


def num_moe_layers(args) -> int:
    """How many decoder layers are MoE (--moe-layer-freq; none without --num-experts)."""
    return sum(moe_layer_pattern(args.moe_layer_freq, args.num_layers)) if args.num_experts else 0


def pattern_with_mtp(args) -> list:
    """1 (MoE) or 0 (dense) per decoder layer, then per MTP layer (--mtp-num-layers), which
    takes the last decoder layer's kind (models/gpt.py's mtp_block_spec)."""
    pattern = (moe_layer_pattern(args.moe_layer_freq, args.num_layers) if args.num_experts
               else [0] * args.num_layers)
    return pattern + pattern[-1:] * mtp_flags.num_layers(args)


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int, multiple: int = 128) -> int:
    """Round the vocabulary up to a multiple of lcm(128, TP): divisible by every usual TP size,
    so the same model (and the same losses) result for TP 1, 2, 4 and 8. Megatron-LM pads to
    128 x TP instead, which changes the model with the layout."""
    step = math.lcm(multiple, tensor_parallel_size)
    return -(-vocab_size // step) * step
