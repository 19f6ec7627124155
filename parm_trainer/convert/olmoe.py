"""The project's GPT-MoE with --qk-layernorm-across-heads as a Hugging Face OlmoeForCausalLM.

OLMoE's q_norm and k_norm are RMSNorms of the whole query projection (width hidden size) and
the whole key projection (key/value heads x channels), over all heads at once: the project's
--qk-layernorm --qk-layernorm-across-heads (models/qk_norm.py), the weight's channels in the
same head order. Every layer is MoE (no dense layers), no shared expert; the router is
softmax over all experts at the top k, renormalised where norm_topk_prob is true. Its
attention_bias puts a bias on the output projection too: --add-qkv-bias is written with
attention_bias true and that bias zero, and imports only so. clip_qkv (clamping q, k and v)
has no counterpart and is refused.
"""

from __future__ import annotations

from parm_trainer.convert.decoder import (NotExportable, Target, common_flags, experts_of,
                                          heads, rope, router_flags, softmax_router_problem)
from parm_trainer.convert.qwen2_moe import expert
from parm_trainer.convert.qwen3_moe import _zeros
from parm_trainer.layer_pattern import moe_layer_pattern

CONFIG_CLASS = "OlmoeConfig"
TARGET = Target(class_name="OlmoeForCausalLM", router="mlp.gate.weight", expert=expert,
                dense=(), zeros=_zeros)


def problem(args: dict):
    """Why OLMoE cannot express run.json's model (None where it can)."""
    router = softmax_router_problem(args, TARGET.class_name)
    if router is not None:
        return router
    count, _, channels = heads(args)
    if args.get("moe_shared_expert_intermediate_size"):
        return "--moe-shared-expert-intermediate-size: OlmoeForCausalLM has no shared expert"
    if not all(moe_layer_pattern(args.get("moe_layer_freq") or 1, args["num_layers"])):
        return "--moe-layer-freq with dense layers: every OlmoeForCausalLM layer is MoE"
    if count * channels != args["hidden_size"]:
        return (f"--kv-channels {channels} x --num-attention-heads {count} is not --hidden-size "
                f"{args['hidden_size']}: OlmoeForCausalLM's heads span the hidden size")
    return None


def hf_config(args: dict, vocab_size: int, bos: int, eos: int) -> dict:
    """OlmoeConfig's arguments for the model run.json describes."""
    count, groups, _ = heads(args)
    return dict(
        vocab_size=vocab_size, hidden_size=args["hidden_size"],
        intermediate_size=args["moe_ffn_hidden_size"], num_hidden_layers=args["num_layers"],
        num_attention_heads=count, num_key_value_heads=groups,
        num_experts=args["num_experts"], num_experts_per_tok=args["moe_router_topk"],
        norm_topk_prob=not args.get("moe_router_pre_softmax"),
        max_position_embeddings=args["max_position_embeddings"],
        rms_norm_eps=args["norm_epsilon"], **rope(args), clip_qkv=None,
        attention_bias=bool(args.get("add_qkv_bias")),
        tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
        router_aux_loss_coef=args.get("moe_aux_loss_coeff") or 0.0, hidden_act="silu",
        attention_dropout=0.0, bos_token_id=bos, eos_token_id=eos, pad_token_id=None,
        dtype="float32")


def model_flags(config: dict) -> dict:
    """pretrain_gpt_moe.py's model arguments (attribute names) for an OLMoE config.json."""
    if config.get("clip_qkv") is not None:
        raise NotExportable(f"clip_qkv {config['clip_qkv']}: the project's attention does not "
                            f"clamp q, k and v; only clip_qkv null imports")
    flags = common_flags(config, experts_of(config), config["intermediate_size"])
    if flags["kv_channels"] * flags["num_attention_heads"] != config["hidden_size"]:
        raise NotExportable("head_dim x num_attention_heads is not hidden_size: OLMoE's q_norm "
                            "spans the hidden size")
    return {**flags, "ffn_hidden_size": config["intermediate_size"], **router_flags(config),
            "qk_layernorm": True, "qk_layernorm_across_heads": True,
            "add_qkv_bias": bool(config.get("attention_bias"))}
