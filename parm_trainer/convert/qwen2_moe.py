"""The project's GPT-MoE as a Hugging Face Qwen2MoeForCausalLM, and a Qwen2-MoE back.

Qwen2-MoE expresses what Mixtral does not: the router of --moe-router-pre-softmax (the softmax
over all experts at the top k, not renormalised: norm_topk_prob false; megatron's default
router is norm_topk_prob true), dense layers between the MoE layers (--moe-layer-freq F,
layer i MoE when i % F == 0, or a list of 1s and 0s: written as mlp_only_layers; a dense
layer's MLP has --ffn-hidden-size; decoder_sparse_step read back), QKV biases
(--add-qkv-bias: qkv_bias) and a shared expert with its sigmoid gate
(--moe-shared-expert-intermediate-size with --moe-shared-expert-gate: megatron's
SharedExpertMLP gives sigmoid(x . gate_weight) * shared(x), as Qwen2-MoE's
sigmoid(shared_expert_gate(x)) * shared_expert(x)). Qwen2-MoE always has a shared expert: a
model without one is written with one of width 0 (its gate weight zeros), whose output is
exactly 0, and such a directory imports only in that form.
"""

from __future__ import annotations

from parm_trainer.layer_pattern import moe_layer_pattern
from parm_trainer.convert.decoder import (Target, common_flags, experts_of, glu, heads,
                                          no_sliding_window, rope, router_flags, same,
                                          softmax_router_problem)

CONFIG_CLASS = "Qwen2MoeConfig"
SHARED = tuple(f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")) + (
    "mlp.shared_expert_gate.weight",)


def _zeros(shape, i: int) -> dict:
    if not shape.moe[i] or shape.shared_ffn:
        return {}
    return dict(zip(SHARED, ((0, shape.h), (0, shape.h), (shape.h, 0), (1, shape.h))))


def _shared(shape, i: int) -> list:
    """The Rules of an MoE layer's shared expert and its sigmoid gate, where the model has
    them."""
    if not shape.moe[i] or not shape.shared_ffn:
        return []
    ours, theirs = f"decoder.layers.{i}.mlp.shared_experts.", f"model.layers.{i}."
    gate, up, down, sigmoid_gate = (theirs + name for name in SHARED)
    out = [glu(ours + "linear_fc1.weight", gate, up), same(ours + "linear_fc2.weight", down)]
    return out + ([same(ours + "gate_weight", sigmoid_gate)] if shape.shared_gate else [])


def expert(e: int) -> tuple:
    return tuple(f"mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down"))


DENSE = tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
TARGET = Target(class_name="Qwen2MoeForCausalLM", router="mlp.gate.weight", expert=expert,
                dense=DENSE, zeros=_zeros, extra=_shared)


def problem(args: dict):
    """Why Qwen2-MoE cannot express run.json's model (None where it can)."""
    router = softmax_router_problem(args, TARGET.class_name)
    if router is not None:
        return router
    if args.get("moe_shared_expert_intermediate_size") and not args.get("moe_shared_expert_gate"):
        return ("--moe-shared-expert-intermediate-size without --moe-shared-expert-gate: "
                "Qwen2MoeForCausalLM's shared expert always has its sigmoid gate")
    if args.get("qk_layernorm"):
        return "--qk-layernorm: Qwen2MoeForCausalLM has no query/key norms"
    return None


def layer_config(args: dict) -> dict:
    """The entries of a Qwen2-MoE or Qwen3-MoE config that the layers and router give."""
    count, groups, channels = heads(args)
    pattern = moe_layer_pattern(args.get("moe_layer_freq") or 1, args["num_layers"])
    return dict(
        hidden_size=args["hidden_size"],
        intermediate_size=args.get("ffn_hidden_size") or args["moe_ffn_hidden_size"],
        moe_intermediate_size=args["moe_ffn_hidden_size"], num_hidden_layers=args["num_layers"],
        num_attention_heads=count, num_key_value_heads=groups, head_dim=channels,
        num_experts=args["num_experts"], num_experts_per_tok=args["moe_router_topk"],
        norm_topk_prob=not args.get("moe_router_pre_softmax"), decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
        max_position_embeddings=args["max_position_embeddings"],
        rms_norm_eps=args["norm_epsilon"], **rope(args), use_sliding_window=False,
        sliding_window=None, tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
        router_aux_loss_coef=args.get("moe_aux_loss_coeff") or 0.0, hidden_act="silu",
        attention_dropout=0.0, dtype="float32")


def hf_config(args: dict, vocab_size: int, bos: int, eos: int) -> dict:
    """Qwen2MoeConfig's arguments for the model run.json describes."""
    return dict(layer_config(args), vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos,
                shared_expert_intermediate_size=args.get(
                    "moe_shared_expert_intermediate_size") or 0,
                qkv_bias=bool(args.get("add_qkv_bias")))


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


def layer_flags(config: dict) -> dict:
    """The model arguments a Qwen2-MoE or Qwen3-MoE config's layers and router give."""
    no_sliding_window(config)
    return {**common_flags(config, experts_of(config), config["moe_intermediate_size"]),
            "ffn_hidden_size": config["intermediate_size"],
            "moe_layer_freq": _layer_freq(config), **router_flags(config)}


def model_flags(config: dict) -> dict:
    """pretrain_gpt_moe.py's model arguments (attribute names) for a Qwen2-MoE config.json."""
    shared = config.get("shared_expert_intermediate_size") or 0
    flags = {**layer_flags(config), "add_qkv_bias": config.get("qkv_bias", True)}
    if shared:
        flags.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return flags
