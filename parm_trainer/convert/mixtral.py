"""The project's GPT-MoE as a Hugging Face MixtralForCausalLM, and a Mixtral back.

Mixtral expresses a model exactly when, beyond decoder.REQUIRED, every layer is MoE and the
router is megatron's default (the softmax of the top-k logits; Mixtral takes the softmax over
all experts renormalised over the top k, the same function; no sigmoid scores, expert bias,
scaling or groups), with no QKV bias, query/key norm or shared expert. Its per-expert names are
`block_sparse_moe.experts.N.w1/w3/w2` (gate, up, down).
"""

from __future__ import annotations

from parm_trainer.convert.decoder import (NotExportable, Target, common_flags, heads, rope,
                                          softmax_router_problem)

TARGET = Target(class_name="MixtralForCausalLM", router="block_sparse_moe.gate.weight",
                expert=lambda e: tuple(f"block_sparse_moe.experts.{e}.{w}.weight"
                                       for w in ("w1", "w3", "w2")),
                dense=(), zeros=lambda shape, i: {})

CONFIG_CLASS = "MixtralConfig"
ONLY_MIXTRAL = {
    "moe_layer_freq": (1, "--moe-layer-freq 1 (every layer MoE)"),
    "moe_router_pre_softmax": (False, "no --moe-router-pre-softmax (softmax over the top k)"),
}


NONE_OF = ("add_qkv_bias", "qk_layernorm", "moe_shared_expert_intermediate_size")


def expresses(args: dict) -> bool:
    return (all(args.get(flag) == needed for flag, (needed, _) in ONLY_MIXTRAL.items())
            and not any(args.get(flag) for flag in NONE_OF)
            and softmax_router_problem(args, TARGET.class_name) is None)


def hf_config(args: dict, vocab_size: int, bos: int, eos: int) -> dict:
    """MixtralConfig's arguments for the model run.json describes."""
    count, groups, channels = heads(args)
    return dict(
        vocab_size=vocab_size, hidden_size=args["hidden_size"],
        intermediate_size=args["moe_ffn_hidden_size"], num_hidden_layers=args["num_layers"],
        num_attention_heads=count, num_key_value_heads=groups, head_dim=channels,
        num_local_experts=args["num_experts"], num_experts_per_tok=args["moe_router_topk"],
        max_position_embeddings=args["max_position_embeddings"],
        rms_norm_eps=args["norm_epsilon"], **rope(args),
        tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
        router_aux_loss_coef=args.get("moe_aux_loss_coeff") or 0.0,
        hidden_act="silu", attention_dropout=0.0, sliding_window=None,
        bos_token_id=bos, eos_token_id=eos, dtype="float32",
    )


def model_flags(config: dict) -> dict:
    """pretrain_gpt_moe.py's model arguments (attribute names) for a Mixtral config.json."""
    if config.get("sliding_window"):
        raise NotExportable(f"sliding_window {config['sliding_window']}: attention over a "
                            f"window is not supported; only full causal attention imports")
    return {**common_flags(config, config["num_local_experts"], config["intermediate_size"]),
            "ffn_hidden_size": config["intermediate_size"]}
