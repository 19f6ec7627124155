"""Megatron-LM's flags for multi-latent attention (DeepSeek-V2/V3) and its YaRN RoPE.

Each keeps Megatron-LM's name, type and default (megatron/training/arguments.py, tag
core_v0.16.1: `--multi-latent-attention` from TransformerConfig's fields, the rest from its
"mla" group and `--rope-type`). With `--multi-latent-attention` the model is
megatron-core's MLASelfAttention built from an MLATransformerConfig (models/config.py): queries
through a low-rank down projection (`--q-lora-rank`; none: one projection), keys and values
through one shared latent of `--kv-lora-rank` channels plus one rotary key of
`--qk-pos-emb-head-dim` channels shared by the heads; each head's query and key have
`--qk-head-dim` channels without position and `--qk-pos-emb-head-dim` with it, its value
`--v-head-dim`. `--qk-layernorm` (defined in arguments/flags.py) puts an RMSNorm on the query
and key/value latents here (DeepSeek's q_a_layernorm and kv_a_layernorm). YaRN's other
constants (beta fast 32, beta slow 1, original maximum positions 4096) are
MLATransformerConfig's defaults: Megatron-LM has no flags for them.
"""

from __future__ import annotations

from typing import Optional

# the flags' MLATransformerConfig fields, each of the flag's own name
CONFIG_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                 "v_head_dim", "rotary_scaling_factor", "mscale", "mscale_all_dim")


def add_flags(parser) -> None:
    g = parser.add_argument_group("multi-latent attention")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="Multi-latent attention (DeepSeek-V2/V3): megatron-core's "
                        "MLASelfAttention; its sizes are the flags below.")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="Rank of the query's low-rank projection (default: none, one "
                        "projection from the hidden states).")
    g.add_argument("--kv-lora-rank", type=int, default=32,
                   help="Rank of the keys' and values' shared latent.")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="Query and key channels per head without position (the head's query "
                        "has this plus --qk-pos-emb-head-dim).")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                   help="Query and key channels per head that carry the rotary position.")
    g.add_argument("--v-head-dim", type=int, default=128, help="Value channels per head.")
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="RoPE of multi-latent attention: rope, or yarn (its default) with "
                        "--rotary-scaling-factor, --mscale, --mscale-all-dim.")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN's scaling factor (the context's extension).")
    g.add_argument("--mscale", type=float, default=1.0,
                   help="YaRN's mscale in multi-latent attention.")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="YaRN's mscale of all dimensions in multi-latent attention (it scales "
                        "the softmax too).")


def config_fields(args) -> dict:
    """MLATransformerConfig's fields of these flags (none without --multi-latent-attention)."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    fields = {name: getattr(args, name) for name in CONFIG_FIELDS}
    fields.update(multi_latent_attention=True, rotary_base=float(args.rotary_base))
    if args.rope_type is not None:  # else MLATransformerConfig's default, yarn
        fields["rope_type"] = args.rope_type
    return fields


def problem(args) -> Optional[str]:
    """The first impossible combination of these flags, as one line; None if none (each
    value's own range is flag_ranges.py's)."""
    if not args.multi_latent_attention:
        if args.rope_type == "yarn":  # Megatron-LM asserts it (core_transformer_config_from_args)
            return ("--rope-type yarn needs --multi-latent-attention (other attention takes "
                    "--rope-type rope only)")
        return None
    if args.group_query_attention:
        return ("--multi-latent-attention and --group-query-attention exclude each other (as in "
                "Megatron-LM): the heads share one key/value latent")
    if args.qk_pos_emb_head_dim % 2:
        return (f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim} must be even: RoPE turns "
                f"channels in pairs")
    tp = args.tensor_model_parallel_size
    # megatron-core splits the down projections' outputs over the tensor-parallel ranks too
    for flag, size in (("--q-lora-rank", args.q_lora_rank),
                       ("--kv-lora-rank + --qk-pos-emb-head-dim",
                        args.kv_lora_rank + args.qk_pos_emb_head_dim)):
        if size is not None and size % tp:
            return (f"{flag} ({size}) must be divisible by --tensor-model-parallel-size {tp} "
                    f"(megatron-core splits the down projection's output over it)")
    return None


def attention_sizes(args) -> dict:
    """Per layer: the attention's projection weights (unsharded), split into those split
    over the tensor-parallel ranks and those every rank holds whole, and the channels that
    enter the scores (q . k per head) and the values."""
    heads, h = args.num_attention_heads, args.hidden_size
    if not getattr(args, "multi_latent_attention", False):
        d = getattr(args, "kv_channels", None) or h // heads
        groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
        return dict(split=h * d * (heads + 2 * groups) + heads * d * h, whole=0,
                    score=heads * d, value=heads * d)
    q_dim = args.qk_head_dim + args.qk_pos_emb_head_dim
    rank = args.q_lora_rank
    query = h * heads * q_dim if rank is None else h * rank + rank * heads * q_dim
    latent = args.kv_lora_rank + args.qk_pos_emb_head_dim
    split = (query + h * latent + args.kv_lora_rank * heads * (args.qk_head_dim + args.v_head_dim)
             + heads * args.v_head_dim * h)
    norms = ((rank or 0) + args.kv_lora_rank) if args.qk_layernorm else 0
    return dict(split=split, whole=norms, score=heads * q_dim, value=heads * args.v_head_dim)
