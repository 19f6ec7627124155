"""The project's GPT-MoE as a Hugging Face Qwen2MoeForCausalLM, where Mixtral cannot express it.

Qwen2-MoE expresses what Mixtral does not: the router of --moe-router-pre-softmax (the softmax
over all experts at the top k, not renormalised: norm_topk_prob false; megatron's default
router is norm_topk_prob true) and dense layers between the MoE layers (--moe-layer-freq F,
layer i MoE when i % F == 0, or a list of 1s and 0s: written as mlp_only_layers; a dense
layer's MLP has --ffn-hidden-size). Qwen2-MoE also has what the project's model does not, written so that the
function is the same: QKV biases (zeros) and a shared expert of width 0
(shared_expert_intermediate_size 0; its gate weight zeros), so that its output is exactly 0.
A Qwen2-MoE directory imports only in that form: a real shared expert or a bias is refused.
"""

from __future__ import annotations

from parm_trainer.layer_pattern import moe_layer_pattern
from parm_trainer.convert.decoder import NotExportable, Target, common_flags, heads, rope

CONFIG_CLASS = "Qwen2MoeConfig"


def _zeros(shape, i: int) -> dict:
    q, kv = shape.heads * shape.channels, shape.groups * shape.channels
    out = {f"self_attn.{p}_proj.bias": (rows,) for p, rows in (("q", q), ("k", kv), ("v", kv))}
    if shape.moe[i]:
        out.update({"mlp.shared_expert.gate_proj.weight": (0, shape.h),
                    "mlp.shared_expert.up_proj.weight": (0, shape.h),
                    "mlp.shared_expert.down_proj.weight": (shape.h, 0),
                    "mlp.shared_expert_gate.weight": (1, shape.h)})
    return out


TARGET = Target(class_name="Qwen2MoeForCausalLM", router="mlp.gate.weight",
                expert=lambda e: tuple(f"mlp.experts.{e}.{p}_proj.weight"
                                       for p in ("gate", "up", "down")),
                dense=tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
                zeros=_zeros)


def hf_config(args: dict, vocab_size: int, bos: int, eos: int) -> dict:
    """Qwen2MoeConfig's arguments for the model run.json describes."""
    count, groups, channels = heads(args)
    pattern = moe_layer_pattern(args.get("moe_layer_freq") or 1, args["num_layers"])
    return dict(
        vocab_size=vocab_size, hidden_size=args["hidden_size"],
        intermediate_size=args["ffn_hidden_size"], moe_intermediate_size=args["moe_ffn_hidden_size"],
        shared_expert_intermediate_size=0, num_hidden_layers=args["num_layers"],
        num_attention_heads=count, num_key_value_heads=groups, head_dim=channels,
        num_experts=args["num_experts"], num_experts_per_tok=args["moe_router_topk"],
        norm_topk_prob=not args.get("moe_router_pre_softmax"),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
        max_position_embeddings=args["max_position_embeddings"],
        rms_norm_eps=args["norm_epsilon"], **rope(args), qkv_bias=True,
        use_sliding_window=False, sliding_window=None,
        tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
        router_aux_loss_coef=args.get("moe_aux_loss_coeff") or 0.0,
        hidden_act="silu", attention_dropout=0.0,
        bos_token_id=bos, eos_token_id=eos, dtype="float32",
    )


def _layer_freq(config: dict):
    """--moe-layer-freq of a config's MoE layers: N where they are every N-th from layer 0,
    else the list of 1s (MoE) and 0s (dense) layer by layer."""
    layers = config["num_hidden_layers"]
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or [])
    moe = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    for freq in range(1, layers + 1):
        if moe == moe_layer_pattern(freq, layers):
            return freq
    return moe


def model_flags(config: dict) -> dict:
    """pretrain_gpt_moe.py's model arguments (attribute names) for a Qwen2-MoE config.json."""
    if config.get("use_sliding_window"):
        raise NotExportable("use_sliding_window true: attention over a window is not "
                            "supported; only full causal attention imports")
    if config.get("shared_expert_intermediate_size"):
        raise NotExportable(f"shared_expert_intermediate_size "
                            f"{config['shared_expert_intermediate_size']}: the project's MoE "
                            f"layer has no shared expert; only 0 imports")
    pre_softmax = not config.get("norm_topk_prob", False)
    if config["num_experts_per_tok"] == 1 and not pre_softmax:
        raise NotExportable("num_experts_per_tok 1 with norm_topk_prob true (every routing "
                            "weight 1): the project's top-1 router is the pre-softmax one")
    return {**common_flags(config, config["num_experts"], config["moe_intermediate_size"]),
            "ffn_hidden_size": config["intermediate_size"],
            "moe_layer_freq": _layer_freq(config), "moe_router_pre_softmax": pre_softmax}
