"""The project's GPT-MoE with multi-latent attention as a Hugging Face DeepseekV3ForCausalLM,
and a DeepSeek-V3 back.

Attention (megatron-core's MLASelfAttention <-> DeepseekV3Attention), tensor for tensor:
q_a_proj / q_a_layernorm / q_b_proj (q_proj without a query latent) are linear_q_down_proj /
q_layernorm / linear_q_up_proj (linear_q_proj), kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj
are linear_kv_down_proj / kv_layernorm / linear_kv_up_proj. Both lay the rows out alike: each
query head's channels without position, then its rotary ones; the key/value latent, then the
one rotary key; each head's key channels, then its value channels. megatron-core's MLA takes
the rotary channels as interleaved pairs (x0, x1), (x2, x3), ... (rope_utils: t[0::2], t[1::2]),
which is transformers' rope_interleave true; a checkpoint with rope_interleave false rotates the
halves (x_j, x_{j+d/2}) instead, so its rotary rows are interleaved on import (the same
function) and it exports with rope_interleave true.

The MoE layers: the sigmoid router with the aux-loss-free expert bias (e_score_correction_bias
is megatron's expert_bias buffer), group-limited top-k (n_group, topk_group; transformers ranks
a group by its top two scores, megatron by its top topk / topk_group: they agree where that is
2), routed_scaling_factor, normalised top-k weights (megatron normalises sigmoid scores for
top-k > 1, never for top-1), the shared experts as one of width n_shared_experts x
moe_intermediate_size without a gate; the first first_k_dense_replace layers dense.
YaRN's constants that Megatron-LM has no flags for must be MLATransformerConfig's defaults.

Multi-token prediction: DeepSeek's files hold MTP layer j (num_nextn_predict_layers of them) as
layer num_hidden_layers + j: a decoder layer's tensors (megatron-core's MTP transformer_layer),
enorm, hnorm, eh_proj, shared_head.norm (final_layernorm), and embed_tokens and shared_head.head,
copies of the model's embedding and output layer, which megatron-core's MTP layers share. An
import keeps them (--mtp-num-layers) where the files have them (transformers writes
num_nextn_predict_layers 1 without them); an export writes them and the count.
"""

from __future__ import annotations

import math

from parm_trainer.convert.decoder import NotExportable, Target, common_flags, glu, same
from parm_trainer.layer_pattern import moe_layer_pattern

CONFIG_CLASS = "DeepseekV3Config"
# YaRN's constants without a Megatron-LM flag: MLATransformerConfig's values
YARN_FIXED = {"beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096}
LATENT_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm: DeepseekV3RMSNorm's default


def _attention(shape, i: int) -> list:
    """The Rules of layer i's multi-latent attention (renames, tensor for tensor)."""
    if shape.q_lora_rank is None:
        query = [("linear_q_proj", "q_proj")]
    else:
        query = [("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
                 ("linear_q_up_proj", "q_b_proj")]
    pairs = query + [("linear_kv_down_proj", "kv_a_proj_with_mqa"),
                     ("kv_layernorm", "kv_a_layernorm"), ("linear_kv_up_proj", "kv_b_proj")]
    return [same(f"decoder.layers.{i}.self_attention.{ours}.weight",
                 f"model.layers.{i}.self_attn.{theirs}.weight") for ours, theirs in pairs]


def _extra(shape, i: int) -> list:
    """The Rules of an MoE layer's expert bias and shared experts, where the model has them."""
    if not shape.moe[i]:
        return []
    ours, theirs = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    out = []
    if shape.expert_bias:
        out.append(same(ours + "router.expert_bias", theirs + "gate.e_score_correction_bias"))
    if shape.shared_ffn:
        out += [glu(ours + "shared_experts.linear_fc1.weight",
                    theirs + "shared_experts.gate_proj.weight",
                    theirs + "shared_experts.up_proj.weight"),
                same(ours + "shared_experts.linear_fc2.weight",
                     theirs + "shared_experts.down_proj.weight")]
    return out


def _zeros(shape, i: int) -> dict:
    """What a model without the expert bias or the shared expert writes: zeros of the form
    that computes the same (a bias of 0, a shared expert of width 0)."""
    if not shape.moe[i]:
        return {}
    out = {} if shape.expert_bias else {"mlp.gate.e_score_correction_bias": (shape.experts,)}
    if not shape.shared_ffn:
        out.update({"mlp.shared_experts.gate_proj.weight": (0, shape.h),
                    "mlp.shared_experts.up_proj.weight": (0, shape.h),
                    "mlp.shared_experts.down_proj.weight": (shape.h, 0)})
    return out


def _mtp(shape, j: int) -> list:
    """The Rules of MTP layer j's tensors beside its transformer layer."""
    ours, theirs = f"mtp.layers.{j}.", f"model.layers.{shape.layers + j}."
    return [same(ours + name + ".weight", theirs + hf + ".weight") for name, hf in (
        ("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
        ("final_layernorm", "shared_head.norm"))]


def _copies(shape) -> dict:
    """MTP layers' embedding and head: copies of the model's (the head of a tied model is the
    embedding)."""
    head = "model.embed_tokens.weight" if shape.tied else "lm_head.weight"
    out = {}
    for j in range(shape.mtp):
        layer = f"model.layers.{shape.layers + j}."
        out[layer + "embed_tokens.weight"] = "model.embed_tokens.weight"
        out[layer + "shared_head.head.weight"] = head
    return out


TARGET = Target(class_name="DeepseekV3ForCausalLM", router="mlp.gate.weight",
                expert=lambda e: tuple(f"mlp.experts.{e}.{p}_proj.weight"
                                       for p in ("gate", "up", "down")),
                dense=tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
                zeros=_zeros, extra=_extra, attention=_attention, mtp=_mtp, copies=_copies)


def weight_flags(config: dict, names) -> dict:
    """--mtp-num-layers where the files (names: their tensors) hold the MTP layers that
    num_nextn_predict_layers counts (any of them: the import then wants them all), else
    nothing."""
    count, layers = config.get("num_nextn_predict_layers") or 0, config["num_hidden_layers"]
    held = any(name.startswith(f"model.layers.{layers + j}.") for name in names
               for j in range(count))
    if not held:
        return {}
    if (config.get("first_k_dense_replace") or 0) >= layers:
        raise NotExportable(f"num_nextn_predict_layers {count} with every decoder layer dense: "
                            f"megatron-core's MTP layers take the last decoder layer's kind, "
                            f"DeepSeek-V3's are MoE layers")
    return {"mtp_num_layers": count}


def _first_dense(args: dict) -> int:
    """first_k_dense_replace of run.json's layers: dense ones first, then only MoE ones."""
    pattern = moe_layer_pattern(args.get("moe_layer_freq") or 1, args["num_layers"])
    first = pattern.index(1) if 1 in pattern else len(pattern)
    if not all(pattern[first:]):
        raise NotExportable(f"--moe-layer-freq {args.get('moe_layer_freq')}: "
                            f"DeepseekV3ForCausalLM has its dense layers first, then only MoE "
                            f"layers")
    return first


def _rope_parameters(args: dict) -> dict:
    theta = float(args["rotary_base"])
    mscale = _softmax_mscale(args["rotary_scaling_factor"], args["mscale_all_dim"])
    if (args.get("rope_type") or "yarn") == "rope":
        if mscale != 1.0:
            raise NotExportable("--rope-type rope with --rotary-scaling-factor and "
                                "--mscale-all-dim (a scaled softmax): DeepSeek-V3 scales it "
                                "with YaRN only")
        return {"rope_type": "default", "rope_theta": theta}
    if args["mscale_all_dim"] and not args["mscale"]:
        raise NotExportable("--mscale 0 with --mscale-all-dim: transformers' YaRN then takes "
                            "mscale 1")
    return {"rope_type": "yarn", "rope_theta": theta, "factor": args["rotary_scaling_factor"],
            "mscale": args["mscale"], "mscale_all_dim": args["mscale_all_dim"], **YARN_FIXED}


def _softmax_mscale(factor: float, mscale_all_dim: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0


def problem(args: dict):
    """Why DeepSeek-V3 cannot express run.json's model (None where it can): hf_config's
    refusals, before anything is written."""
    try:
        hf_config(args, 0, None, None)
    except NotExportable as why:
        return str(why)
    return None


def hf_config(args: dict, vocab_size: int, bos: int, eos: int) -> dict:
    """DeepseekV3Config's arguments for the model run.json describes."""
    if not args.get("qk_layernorm"):
        raise NotExportable("--multi-latent-attention without --qk-layernorm: DeepSeek-V3 has "
                            "norms on its query and key/value latents (train with "
                            "--qk-layernorm)")
    if args["norm_epsilon"] != LATENT_EPS:
        raise NotExportable(f"--norm-epsilon {args['norm_epsilon']}: DeepSeek-V3 normalises its "
                            f"latents with {LATENT_EPS} (train with --norm-epsilon {LATENT_EPS})")
    if args.get("moe_router_score_function") != "sigmoid" or args.get("moe_router_pre_softmax"):
        raise NotExportable(f"--moe-router-score-function "
                            f"{args.get('moe_router_score_function')}: DeepSeek-V3 routes on "
                            f"sigmoid scores (--moe-router-score-function sigmoid, without "
                            f"--moe-router-pre-softmax)")
    experts, topk = args["num_experts"], args["moe_router_topk"]
    groups, group_topk = args.get("moe_router_num_groups"), args.get("moe_router_group_topk")
    if group_topk and group_topk < groups and topk // group_topk != 2:
        raise NotExportable(f"--moe-router-topk {topk} over --moe-router-group-topk "
                            f"{group_topk}: DeepSeek-V3 ranks a group by its top 2 scores, "
                            f"megatron by its top topk / group-topk")
    if not group_topk or group_topk >= groups:
        groups = group_topk = 1
    shared = args.get("moe_shared_expert_intermediate_size") or 0
    ffn = args["moe_ffn_hidden_size"]
    if shared % ffn or args.get("moe_shared_expert_gate"):
        raise NotExportable(f"--moe-shared-expert-intermediate-size {shared}"
                            f"{' with a gate' if shared % ffn == 0 else ''}: DeepSeek-V3's "
                            f"shared experts are n x --moe-ffn-hidden-size {ffn} wide, ungated")
    return dict(
        vocab_size=vocab_size, hidden_size=args["hidden_size"],
        intermediate_size=args["ffn_hidden_size"], moe_intermediate_size=ffn,
        num_hidden_layers=args["num_layers"], num_attention_heads=args["num_attention_heads"],
        num_key_value_heads=args["num_attention_heads"], n_shared_experts=shared // ffn,
        n_routed_experts=experts,
        routed_scaling_factor=args.get("moe_router_topk_scaling_factor") or 1.0,
        kv_lora_rank=args["kv_lora_rank"], q_lora_rank=args.get("q_lora_rank"),
        qk_rope_head_dim=args["qk_pos_emb_head_dim"], v_head_dim=args["v_head_dim"],
        qk_nope_head_dim=args["qk_head_dim"], n_group=groups, topk_group=group_topk,
        num_experts_per_tok=topk, first_k_dense_replace=_first_dense(args),
        norm_topk_prob=topk > 1, hidden_act="silu",
        max_position_embeddings=args["max_position_embeddings"],
        rms_norm_eps=args["norm_epsilon"], rope_parameters=_rope_parameters(args),
        rope_interleave=True, attention_bias=False, attention_dropout=0.0,
        tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
        bos_token_id=bos, eos_token_id=eos, dtype="float32",
        num_nextn_predict_layers=args.get("mtp_num_layers") or 0,
    )


def _refuse_what_differs(config: dict) -> None:
    """One line for the first thing the project's model cannot compute alike."""
    topk, norm = config["num_experts_per_tok"], config.get("norm_topk_prob", True)
    groups, group_topk = config.get("n_group") or 1, config.get("topk_group") or 1
    for wrong, line in (
            (config.get("attention_bias"), "attention_bias true: megatron-core's multi-latent "
                                           "attention has no biases"),
            (config.get("rms_norm_eps", LATENT_EPS) != LATENT_EPS,
             f"rms_norm_eps {config.get('rms_norm_eps')}: transformers' DeepSeek-V3 takes "
             f"{LATENT_EPS} in its latents' norms, megatron-core one epsilon for all norms"),
            (config.get("hidden_act", "silu") != "silu",
             f"hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) imports"),
            (topk > 1 and not norm, f"norm_topk_prob false with num_experts_per_tok {topk}: "
                                    f"megatron normalises the top-k sigmoid scores"),
            (topk == 1 and norm, "norm_topk_prob true with num_experts_per_tok 1 (every "
                                 "routing weight 1): megatron's top-1 sigmoid weight is the "
                                 "score"),
            (group_topk < groups and topk // group_topk != 2,
             f"num_experts_per_tok {topk} over topk_group {group_topk}: transformers ranks a "
             f"group by its top 2 scores, megatron by its top num_experts_per_tok / "
             f"topk_group"),
            (config.get("n_routed_experts", 0) % groups,
             f"n_routed_experts {config.get('n_routed_experts')} in n_group {groups}")):
        if wrong:
            raise NotExportable(line)


def _rope_flags(config: dict) -> dict:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if float(theta) != int(theta):
        raise NotExportable(f"rope_theta {theta} is not an integer (--rotary-base)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rotary_base": int(theta), "rope_type": "rope"}
    if kind != "yarn":
        raise NotExportable(f"rope_type {kind!r}: only the default RoPE and yarn import")
    for name, value in YARN_FIXED.items():
        if float(rope.get(name) or value) != value:
            raise NotExportable(f"rope_parameters {name} {rope[name]}: megatron-core's YaRN "
                                f"takes {value} (Megatron-LM has no flag for it)")
    for name in ("attention_factor", "partial_rotary_factor"):
        if rope.get(name) is not None:
            raise NotExportable(f"rope_parameters {name} {rope[name]}: not a YaRN setting "
                                f"megatron-core's multi-latent attention has")
    if rope.get("factor") is None or rope.get("truncate") is False:
        raise NotExportable("rope_parameters without factor, or with truncate false: "
                            "megatron-core's YaRN needs the factor and rounds its range")
    mscale, all_dim = rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
    if not (mscale and all_dim):  # transformers' YaRN: then get_mscale(factor) alone
        if all_dim:
            raise NotExportable(f"rope_parameters mscale_all_dim {all_dim} without mscale: "
                                f"transformers' YaRN and megatron-core's differ there")
        mscale = 1.0
    return {"rotary_base": int(theta), "rope_type": "yarn",
            "rotary_scaling_factor": float(rope["factor"]), "mscale": float(mscale),
            "mscale_all_dim": float(all_dim)}


def model_flags(config: dict) -> dict:
    """pretrain_gpt_moe.py's model arguments (attribute names) for a DeepSeek-V3 config.json."""
    _refuse_what_differs(config)
    rope = _rope_flags(config)
    layers, dense = config["num_hidden_layers"], config.get("first_k_dense_replace") or 0
    groups, group_topk = config.get("n_group") or 1, config.get("topk_group") or 1
    ffn, shared = config["moe_intermediate_size"], config.get("n_shared_experts") or 0
    scaling = config.get("routed_scaling_factor", 1.0)
    flat = {**config, "rope_parameters": {"rope_theta": rope["rotary_base"]}, "head_dim": None,
            "num_key_value_heads": None}
    return {**common_flags(flat, config["n_routed_experts"], ffn), **rope,
            "kv_channels": None, "ffn_hidden_size": config["intermediate_size"],
            "moe_layer_freq": 1 if not dense else [0] * dense + [1] * (layers - dense),
            "multi_latent_attention": True, "qk_layernorm": True,
            "q_lora_rank": config.get("q_lora_rank"), "kv_lora_rank": config["kv_lora_rank"],
            "qk_head_dim": config["qk_nope_head_dim"],
            "qk_pos_emb_head_dim": config["qk_rope_head_dim"],
            "v_head_dim": config["v_head_dim"],
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": groups if group_topk < groups else None,
            "moe_router_group_topk": group_topk if group_topk < groups else None,
            "moe_router_topk_scaling_factor": None if scaling == 1.0 else float(scaling),
            "moe_shared_expert_intermediate_size": shared * ffn or None}


def hf_tensor(name: str, tensor, config: dict):
    """A checkpoint's tensor as megatron-core's MLA takes it: with rope_interleave false, each
    rotary block's rows (x_0 .. x_{d/2-1}, x_{d/2} .. x_{d-1}) interleaved to (x_0, x_{d/2},
    x_1, x_{d/2+1}, ...), which megatron-core's MLA pairs as transformers pairs the halves;
    every other tensor as it is."""
    if config.get("rope_interleave", True):
        return tensor
    import torch

    rope, nope = config["qk_rope_head_dim"], config["qk_nope_head_dim"]
    order = torch.arange(rope).view(2, rope // 2).t().reshape(-1)  # 0, d/2, 1, d/2 + 1, ...
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        per_head = tensor.view(config["num_attention_heads"], nope + rope, -1)
        return torch.cat([per_head[:, :nope], per_head[:, nope:][:, order]],
                         dim=1).reshape(tensor.shape)
    if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        latent = config["kv_lora_rank"]
        return torch.cat([tensor[:latent], tensor[latent:][order]])
    return tensor
