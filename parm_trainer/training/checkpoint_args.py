"""--use-checkpoint-args: the model's flags read from the --load checkpoint's run.json.

Megatron-LM's load_args_from_checkpoint (megatron/training/checkpointing.py) takes two kinds of
model argument from the checkpoint: sizes that a command line may still set (Megatron-LM
leaves those given a value), and the rest, always the checkpoint's. Here the same lists, in
this stack's flag names, plus the few more that shape this stack's tensors (the vocabulary's
padding, the norms' epsilon, the query/key norms, the shared expert's gate, group-limited
routing, multi-latent attention's sizes and RoPE). The tokenizer comes with them (Megatron-LM's
--use-tokenizer-model-from-checkpoint-args, on by default): its type and --vocab-size always,
its files where their flags are not given (the checkpoint's own copies: tokenizer.model, or
vocab.json and merges.txt).
"""

from __future__ import annotations

import os

from parm_trainer.training.checkpoint.files import (TOKENIZER_FILES, CheckpointError,
                                                    latest_dir, read_description, read_tracker,
                                                    tokenizer_copy)

UNLESS_GIVEN = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length",
                "num_attention_heads", "kv_channels", "max_position_embeddings",
                "moe_token_dispatcher_type", "mtp_num_layers")
ALWAYS = ("num_query_groups", "group_query_attention", "position_embedding_type",
          "add_position_embedding", "rotary_base", "disable_bias_linear", "add_qkv_bias",
          "swiglu", "untie_embeddings_and_output_weights", "normalization", "attention_dropout",
          "hidden_dropout", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size",
          "moe_router_topk", "moe_router_pre_softmax", "moe_grouped_gemm",
          "moe_shared_expert_intermediate_size", "moe_router_score_function",
          "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
          # this stack's, beside Megatron-LM's list
          "make_vocab_size_divisible_by", "norm_epsilon", "moe_shared_expert_gate",
          "moe_router_num_groups", "moe_router_group_topk", "tokenizer_type", "vocab_size",
          "qk_layernorm", "qk_layernorm_across_heads", "multi_latent_attention", "q_lora_rank",
          "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
          "rotary_scaling_factor", "mscale", "mscale_all_dim")


def apply(args, given: set) -> list:
    """Set args' model flags from args.load's latest checkpoint; given: the flags (attribute
    names) on the command line. Returns the lines to log."""
    if not args.use_checkpoint_args:
        return []
    if not args.load or read_tracker(args.load) is None:
        return [f"--use-checkpoint-args: no checkpoint in --load {args.load}: the flags given "
                f"are used"]
    try:
        saved = read_description(args.load)["args"]
    except (CheckpointError, KeyError, ValueError) as error:
        raise CheckpointError(f"--use-checkpoint-args: {error}") from None
    changed = []
    for name in UNLESS_GIVEN + ALWAYS:
        if name in saved and not (name in UNLESS_GIVEN and name in given):
            if getattr(args, name, None) != saved[name]:
                changed.append(f"{name} {saved[name]}")
            setattr(args, name, saved[name])
    for dest in TOKENIZER_FILES:  # the copies the saved tokenizer type left
        copy = os.path.join(latest_dir(args.load), tokenizer_copy(args.tokenizer_type, dest))
        if dest not in given and os.path.exists(copy):
            setattr(args, dest, copy)
            changed.append(f"{dest} {copy}")
    return [f"--use-checkpoint-args: from {args.load}: "
            + (", ".join(changed) if changed else "the flags given match it")]
