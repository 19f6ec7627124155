"""The project's GPT-MoE <-> Hugging Face MixtralForCausalLM, tensor by tensor.

The project's side is the state dict of its model built on one rank (TP = EP = PP = 1, so every
tensor is whole): megatron-core's local layer names. Mixtral's side uses the per-expert names
(`block_sparse_moe.experts.N.w1/w2/w3`) that transformers 4.x loads as they are and 5.x
converts on load (it also writes them in save_pretrained).

Two layouts differ:
- attention: megatron keeps one fused QKV weight, grouped per key/value head: for each of the g
  groups, its n/g query heads, then its key head, then its value head (d rows each); Mixtral has
  separate q_proj, k_proj, v_proj with heads in order (query head j uses key/value head
  j // (n/g), which is the same grouping);
- experts: megatron's SwiGLU fc1 is [gate; up] (the first half goes through SiLU), Mixtral's
  w1 is the gate and w3 the up projection; fc2 is w2.
Routing is the same function: megatron's default router takes the softmax of the top-k logits,
Mixtral the softmax over all experts renormalised over the top k.
"""

from __future__ import annotations


class NotExportable(ValueError):
    """A model that MixtralForCausalLM cannot express exactly; the message names the flag."""


# flag (as in run.json's args) -> (value Mixtral needs, what to pass to pretrain_gpt_moe.py)
_REQUIRED = {
    "normalization": ("RMSNorm", "--normalization RMSNorm"),
    "swiglu": (True, "--swiglu"),
    "position_embedding_type": ("rope", "--position-embedding-type rope"),
    "disable_bias_linear": (True, "--disable-bias-linear"),
    "moe_layer_freq": (1, "--moe-layer-freq 1 (every layer MoE)"),
    "moe_router_pre_softmax": (False, "no --moe-router-pre-softmax (softmax over the top k)"),
}


def check_exportable(args: dict) -> None:
    if not args.get("num_experts"):
        raise NotExportable("the model has no MoE layers (--num-experts): Mixtral needs them")
    for flag, (needed, fix) in _REQUIRED.items():
        if args.get(flag) != needed:
            raise NotExportable(
                f"--{flag.replace('_', '-')} is {args.get(flag)!r}: MixtralForCausalLM cannot "
                f"express it; a model trained with {fix} exports")


def _heads(args: dict) -> tuple:
    heads = args["num_attention_heads"]
    groups = args["num_query_groups"] if args.get("group_query_attention") else heads
    channels = args.get("kv_channels") or args["hidden_size"] // heads
    return heads, groups, channels


def hf_config(args: dict, vocab_size: int, bos: int, eos: int) -> dict:
    """MixtralConfig's arguments for the model run.json describes."""
    heads, groups, channels = _heads(args)
    return dict(
        vocab_size=vocab_size, hidden_size=args["hidden_size"],
        intermediate_size=args["moe_ffn_hidden_size"], num_hidden_layers=args["num_layers"],
        num_attention_heads=heads, num_key_value_heads=groups, head_dim=channels,
        num_local_experts=args["num_experts"], num_experts_per_tok=args["moe_router_topk"],
        max_position_embeddings=args["max_position_embeddings"],
        rms_norm_eps=args["norm_epsilon"],
        rope_parameters={"rope_type": "default", "rope_theta": float(args["rotary_base"])},
        tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
        router_aux_loss_coef=args.get("moe_aux_loss_coeff") or 0.0,
        hidden_act="silu", attention_dropout=0.0, sliding_window=None,
        bos_token_id=bos, eos_token_id=eos, dtype="float32",
    )


def model_flags(config: dict) -> dict:
    """pretrain_gpt_moe.py's model arguments (attribute names) for a Mixtral config.json."""
    if config.get("model_type") != "mixtral":
        raise NotExportable(f"config.json has model_type {config.get('model_type')!r}; "
                            f"only 'mixtral' (MixtralForCausalLM) imports")
    shape = _shape_of_config(config)
    heads, groups = shape["heads"], shape["groups"]
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 1e6))
    if rope.get("rope_type", "default") != "default":
        raise NotExportable(f"rope_type {rope['rope_type']!r}: only the default RoPE imports")
    if config.get("sliding_window"):
        raise NotExportable(f"sliding_window {config['sliding_window']}: attention over a "
                            f"window is not supported; only full causal attention imports")
    if float(theta) != int(theta):
        raise NotExportable(f"rope_theta {theta} is not an integer (--rotary-base)")
    return {
        "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "num_attention_heads": heads, "kv_channels": shape["channels"],
        "group_query_attention": groups != heads, "num_query_groups": groups,
        "num_experts": config["num_local_experts"],
        "moe_router_topk": config["num_experts_per_tok"],
        "moe_ffn_hidden_size": config["intermediate_size"],
        "ffn_hidden_size": config["intermediate_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "norm_epsilon": config["rms_norm_eps"], "rotary_base": int(theta),
        "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
        "disable_bias_linear": True,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
    }


def _shape(hidden: int, heads: int, groups: int, channels: int, num_layers: int,
           num_experts: int, ffn: int, tied: bool) -> dict:
    return dict(h=hidden, heads=heads, groups=groups, channels=channels, layers=num_layers,
                experts=num_experts, ffn=ffn, tied=tied)


def _shape_of_args(args: dict) -> dict:
    return _shape(args["hidden_size"], *_heads(args), args["num_layers"], args["num_experts"],
                  args["moe_ffn_hidden_size"], not args["untie_embeddings_and_output_weights"])


def _shape_of_config(config: dict) -> dict:
    heads = config["num_attention_heads"]
    return _shape(config["hidden_size"], heads, config.get("num_key_value_heads") or heads,
                  config.get("head_dim") or config["hidden_size"] // heads,
                  config["num_hidden_layers"], config["num_local_experts"],
                  config["intermediate_size"], config.get("tie_word_embeddings", False))


def _renames(shape: dict) -> list:
    """(ours, theirs) for every tensor that is the same in both, layer by layer."""
    pairs = [("decoder.final_layernorm.weight", "model.norm.weight")]
    for i in range(shape["layers"]):
        ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
        pairs += [(ours + "self_attention.linear_proj.weight", theirs + "self_attn.o_proj.weight"),
                  (ours + "input_layernorm.weight", theirs + "input_layernorm.weight"),
                  (ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight"),
                  (ours + "mlp.router.weight", theirs + "block_sparse_moe.gate.weight")]
        pairs += [(f"{ours}mlp.experts.local_experts.{e}.linear_fc2.weight",
                   f"{theirs}block_sparse_moe.experts.{e}.w2.weight")
                  for e in range(shape["experts"])]
    return pairs


def _vocabulary(shape: dict) -> list:
    pairs = [("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    if not shape["tied"]:
        pairs.append(("output_layer.weight", "lm_head.weight"))
    return pairs


def _qkv(i: int) -> tuple:
    attention = f"model.layers.{i}.self_attn."
    return (f"decoder.layers.{i}.self_attention.linear_qkv.weight",
            [attention + name for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight")])


def _fc1(i: int, e: int) -> tuple:
    moe = f"model.layers.{i}.block_sparse_moe.experts.{e}."
    return (f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight",
            [moe + "w1.weight", moe + "w3.weight"])


def to_hf(state: dict, args: dict, vocab_size: int) -> dict:
    """The Mixtral tensors (the first vocab_size embedding rows) of a one-rank state dict."""
    shape = _shape_of_args(args)
    h, groups, channels = shape["h"], shape["groups"], shape["channels"]
    per_group = shape["heads"] // groups
    out = {theirs: state[ours] for ours, theirs in _renames(shape)}
    out.update({theirs: state[ours][:vocab_size] for ours, theirs in _vocabulary(shape)})
    for i in range(shape["layers"]):
        ours, (q, k, v) = _qkv(i)
        qkv = state[ours].view(groups, per_group + 2, channels, h)
        out[q] = qkv[:, :per_group].reshape(-1, h)
        out[k], out[v] = qkv[:, per_group].reshape(-1, h), qkv[:, per_group + 1].reshape(-1, h)
        for e in range(shape["experts"]):
            ours, (gate, up) = _fc1(i, e)
            out[gate], out[up] = state[ours][:shape["ffn"]], state[ours][shape["ffn"]:]
    return {key: value.detach().clone().contiguous() for key, value in out.items()}


def from_hf(tensors: dict, config: dict, padded_vocab_size: int) -> dict:
    """A one-rank state dict from Mixtral tensors; embedding rows past the Hugging Face vocabulary
    (the project pads it for tensor parallelism) are zero."""
    import torch

    shape = _shape_of_config(config)
    h, groups, channels = shape["h"], shape["groups"], shape["channels"]
    per_group = shape["heads"] // groups
    state = {ours: tensors[theirs] for ours, theirs in _renames(shape)}
    for ours, theirs in _vocabulary(shape):
        weight = tensors[theirs]
        state[ours] = torch.zeros(padded_vocab_size, weight.shape[1], dtype=weight.dtype)
        state[ours][:weight.shape[0]] = weight
    for i in range(shape["layers"]):
        ours, (q, k, v) = _qkv(i)
        state[ours] = torch.cat([tensors[q].view(groups, per_group, channels, h),
                                 tensors[k].view(groups, 1, channels, h),
                                 tensors[v].view(groups, 1, channels, h)], dim=1).reshape(-1, h)
        for e in range(shape["experts"]):
            ours, parts = _fc1(i, e)
            state[ours] = torch.cat([tensors[name] for name in parts])
    return state
