"""The project's GPT-MoE with --qk-layernorm as a Hugging Face Qwen3MoeForCausalLM, and back.

Qwen3-MoE is Qwen2-MoE's layout (names, router, dense layers by mlp_only_layers and
decoder_sparse_step) with an RMSNorm of each query and key head before RoPE (q_norm, k_norm:
megatron's --qk-layernorm, one weight of a head's width) and no shared expert. Its
attention_bias puts a bias on the output projection too: --add-qkv-bias is written with
attention_bias true and that bias zero, and imports only so.
"""

from __future__ import annotations

from parm_trainer.convert.decoder import NotExportable, Target, softmax_router_problem
from parm_trainer.convert.qwen2_moe import DENSE, expert, layer_config, layer_flags

CONFIG_CLASS = "Qwen3MoeConfig"


def _zeros(shape, i: int) -> dict:
    return {"self_attn.o_proj.bias": (shape.h,)} if shape.qkv_bias else {}


TARGET = Target(class_name="Qwen3MoeForCausalLM", router="mlp.gate.weight", expert=expert,
                dense=DENSE, zeros=_zeros)


def problem(args: dict):
    """Why Qwen3-MoE cannot express run.json's model (None where it can)."""
    router = softmax_router_problem(args, TARGET.class_name)
    if router is not None:
        return router
    if args.get("moe_shared_expert_intermediate_size"):
        return "--moe-shared-expert-intermediate-size: Qwen3MoeForCausalLM has no shared expert"
    return None


def hf_config(args: dict, vocab_size: int, bos: int, eos: int) -> dict:
    """Qwen3MoeConfig's arguments for the model run.json describes."""
    return dict(layer_config(args), vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos,
                attention_bias=bool(args.get("add_qkv_bias")))


def model_flags(config: dict) -> dict:
    """pretrain_gpt_moe.py's model arguments (attribute names) for a Qwen3-MoE config.json."""
    if config.get("shared_expert_intermediate_size"):
        raise NotExportable("shared_expert_intermediate_size in a Qwen3-MoE config: not "
                            "Qwen3MoeForCausalLM's")
    return {**layer_flags(config), "qk_layernorm": True,
            "add_qkv_bias": bool(config.get("attention_bias"))}
