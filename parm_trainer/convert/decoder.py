"""The project's GPT-MoE decoder <-> a Hugging Face decoder class, tensor by tensor.

The project's side is the state dict of its model built on one rank (TP = EP = PP = 1, so every
tensor is whole): megatron-core's local layer names. The Hugging Face side is a Target
(mixtral.py, qwen2_moe.py): the names of one class, in the per-expert form
(`...experts.N.<projection>.weight`) that transformers 4.x loads as it is and 5.x converts on
load (and writes itself in save_pretrained).

Two layouts differ:
- attention: megatron keeps one fused QKV weight, grouped per key/value head: for each of the g
  groups, its n/g query heads, then its key head, then its value head (d rows each); Hugging
  Face has separate q_proj, k_proj, v_proj with heads in order (query head j uses key/value
  head j // (n/g), which is the same grouping);
- SwiGLU MLPs (experts and dense layers): megatron's fc1 is [gate; up] (the first half goes
  through SiLU), Hugging Face has the gate and the up projection apart; fc2 is the down one.
A Target may also have tensors the project's model does not (Qwen2-MoE's QKV biases and shared
expert): they are written as zeros of the right shape, so the function is the same, and an
import refuses them unless they are zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from parm_trainer.layer_pattern import moe_layer_pattern


class NotExportable(ValueError):
    """A model the Hugging Face class cannot express exactly (or the project's model cannot
    hold); the message names the flag or the tensor."""


# flag (as in run.json's args) -> (value every target needs, what to pass to pretrain_gpt_moe.py)
REQUIRED = {
    "normalization": ("RMSNorm", "--normalization RMSNorm"),
    "swiglu": (True, "--swiglu"),
    "position_embedding_type": ("rope", "--position-embedding-type rope"),
    "disable_bias_linear": (True, "--disable-bias-linear"),
}
CLASSES = "MixtralForCausalLM or Qwen2MoeForCausalLM"


def check_exportable(args: dict) -> None:
    if not args.get("num_experts"):
        raise NotExportable(f"the model has no MoE layers (--num-experts): {CLASSES} needs "
                            f"them")
    for flag, (needed, fix) in REQUIRED.items():
        if args.get(flag) != needed:
            raise NotExportable(
                f"--{flag.replace('_', '-')} is {args.get(flag)!r}: neither {CLASSES} can "
                f"express it; a model trained with {fix} exports")


def heads(args: dict) -> tuple:
    """(attention heads, key/value groups, channels per head) of run.json's args."""
    count = args["num_attention_heads"]
    groups = args["num_query_groups"] if args.get("group_query_attention") else count
    return count, groups, args.get("kv_channels") or args["hidden_size"] // count


def rope(args: dict) -> dict:
    """The RoPE entry of a config (transformers 5.x's rope_parameters; see legacy_keys)."""
    return dict(rope_parameters={"rope_type": "default", "rope_theta": float(args["rotary_base"])})


def legacy_keys(args: dict) -> dict:
    """What config.json needs beside 5.x's save_pretrained output for transformers 4.x to read
    it alike: 4.x reads the RoPE base from rope_theta (5.x writes only rope_parameters, and
    without it 4.x takes its default base of 1e6)."""
    return {"rope_theta": float(args["rotary_base"])}


def rope_theta(config: dict) -> int:
    """--rotary-base of a config.json written by transformers 4.x or 5.x."""
    theta = (config.get("rope_parameters") or {}).get("rope_theta",
                                                       config.get("rope_theta", 1e6))
    rope_type = (config.get("rope_parameters") or config.get("rope_scaling") or {}).get(
        "rope_type", "default")
    if rope_type != "default":
        raise NotExportable(f"rope_type {rope_type!r}: only the default RoPE imports")
    if float(theta) != int(theta):
        raise NotExportable(f"rope_theta {theta} is not an integer (--rotary-base)")
    return int(theta)


def common_flags(config: dict, experts: int, expert_ffn: int) -> dict:
    """The model arguments every imported decoder shares (attribute names)."""
    count = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or count
    return {
        "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "num_attention_heads": count,
        "kv_channels": config.get("head_dim") or config["hidden_size"] // count,
        "group_query_attention": groups != count, "num_query_groups": groups,
        "num_experts": experts, "moe_router_topk": config["num_experts_per_tok"],
        "moe_ffn_hidden_size": expert_ffn,
        "max_position_embeddings": config["max_position_embeddings"],
        "norm_epsilon": config["rms_norm_eps"], "rotary_base": rope_theta(config),
        "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
        "disable_bias_linear": True,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
    }


@dataclass(frozen=True)
class Shape:
    h: int
    heads: int
    groups: int
    channels: int
    experts: int
    ffn: int  # an expert's
    dense_ffn: int  # a dense layer's
    tied: bool
    moe: tuple  # per layer: is it an MoE layer
    shared_ffn: int = 0  # the shared expert's (0: none)
    expert_bias: bool = False  # the router's aux-loss-free bias
    q_lora_rank: Optional[int] = None  # multi-latent attention's query latent (None: none)

    @property
    def layers(self) -> int:
        return len(self.moe)


def shape_of_args(args: dict) -> Shape:
    pattern = moe_layer_pattern(args.get("moe_layer_freq") or 1, args["num_layers"])
    return Shape(args["hidden_size"], *heads(args), args["num_experts"],
                 args["moe_ffn_hidden_size"], args.get("ffn_hidden_size") or 0,
                 not args["untie_embeddings_and_output_weights"],
                 tuple(bool(moe) for moe in pattern),
                 args.get("moe_shared_expert_intermediate_size") or 0,
                 bool(args.get("moe_router_enable_expert_bias")), args.get("q_lora_rank"))


@dataclass(frozen=True)
class Target:
    """One Hugging Face class's names (layer i's prefix is model.layers.{i}.)."""
    class_name: str
    router: str  # the router's weight, under the layer
    expert: Callable  # e -> (gate, up, down) names under the layer
    dense: tuple  # (gate, up, down) of a dense layer's MLP, under the layer
    zeros: Callable  # (shape, layer index) -> {name: tensor shape}: what the model lacks
    # (shape, layer index) -> [(ours, theirs)] under the layers' prefixes: the attention's
    # tensors in place of the fused QKV (None: megatron's fused QKV <-> q, k, v_proj)
    attention: Optional[Callable] = None
    more: Optional[Callable] = None  # (shape, layer index) -> [(ours, theirs)]: more tensors
    more_fc1: Optional[Callable] = None  # (shape, layer index) -> [(ours, [gate, up], rows)]


def _layer(i: int) -> str:
    return f"model.layers.{i}."


def _renames(shape: Shape, target: Target) -> list:
    """(ours, theirs) for every tensor that is the same in both, layer by layer."""
    pairs = [("decoder.final_layernorm.weight", "model.norm.weight")]
    for i in range(shape.layers):
        ours, theirs = f"decoder.layers.{i}.", _layer(i)
        pairs += [(ours + "self_attention.linear_proj.weight", theirs + "self_attn.o_proj.weight"),
                  (ours + "input_layernorm.weight", theirs + "input_layernorm.weight"),
                  (ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight")]
        for mine, other in ((target.attention or _none)(shape, i)
                            + (target.more or _none)(shape, i)):
            pairs.append((ours + mine, theirs + other))
        if shape.moe[i]:
            pairs.append((ours + "mlp.router.weight", theirs + target.router))
            pairs += [(f"{ours}mlp.experts.local_experts.{e}.linear_fc2.weight",
                       theirs + target.expert(e)[2]) for e in range(shape.experts)]
        else:
            pairs.append((ours + "mlp.linear_fc2.weight", theirs + target.dense[2]))
    return pairs


def _none(shape: Shape, i: int) -> list:
    return []


def _vocabulary(shape: Shape) -> list:
    pairs = [("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    if not shape.tied:
        pairs.append(("output_layer.weight", "lm_head.weight"))
    return pairs


def _qkv(target: Target, i: int) -> list:
    """[(ours, [q, k, v])]: megatron's fused QKV of layer i (none where the target's attention
    has its own names)."""
    if target.attention is not None:
        return []
    attention = _layer(i) + "self_attn."
    return [(f"decoder.layers.{i}.self_attention.linear_qkv.weight",
             [attention + name for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight")])]


def _fc1s(shape: Shape, target: Target, i: int) -> list:
    """(ours, [gate, up], rows of each half) of layer i's SwiGLU fc1 weights."""
    ours, theirs = f"decoder.layers.{i}.mlp.", _layer(i)
    if not shape.moe[i]:
        return [(ours + "linear_fc1.weight", [theirs + n for n in target.dense[:2]],
                 shape.dense_ffn)]
    more = [(f"decoder.layers.{i}.{mine}", [theirs + n for n in parts], rows)
            for mine, parts, rows in (target.more_fc1 or _none)(shape, i)]
    return [(f"{ours}experts.local_experts.{e}.linear_fc1.weight",
             [theirs + n for n in target.expert(e)[:2]], shape.ffn)
            for e in range(shape.experts)] + more


def to_hf(state: dict, shape: Shape, target: Target, vocab_size: int) -> dict:
    """The target's tensors (the first vocab_size embedding rows) of a one-rank state dict."""
    import torch

    h, groups, channels = shape.h, shape.groups, shape.channels
    per_group = shape.heads // groups
    out = {theirs: state[ours] for ours, theirs in _renames(shape, target)}
    out.update({theirs: state[ours][:vocab_size] for ours, theirs in _vocabulary(shape)})
    for i in range(shape.layers):
        for ours, (q, k, v) in _qkv(target, i):
            qkv = state[ours].view(groups, per_group + 2, channels, h)
            out[q] = qkv[:, :per_group].reshape(-1, h)
            out[k] = qkv[:, per_group].reshape(-1, h)
            out[v] = qkv[:, per_group + 1].reshape(-1, h)
        for ours, (gate, up), rows in _fc1s(shape, target, i):
            out[gate], out[up] = state[ours][:rows], state[ours][rows:]
        for name, size in target.zeros(shape, i).items():
            out[_layer(i) + name] = torch.zeros(size, dtype=state[ours].dtype)
    return {key: value.detach().clone().contiguous() for key, value in out.items()}


def from_hf(tensors: dict, shape: Shape, target: Target, padded_vocab_size: int) -> dict:
    """A one-rank state dict from the target's tensors; embedding rows past the Hugging Face
    vocabulary (the project pads it for tensor parallelism) are zero. A tensor the model lacks
    must be zero (and of the shape the target gives it), else it is refused by name."""
    import torch

    h, groups, channels = shape.h, shape.groups, shape.channels
    per_group = shape.heads // groups
    state = {ours: tensors[theirs] for ours, theirs in _renames(shape, target)}
    for ours, theirs in _vocabulary(shape):
        weight = tensors[theirs]
        state[ours] = torch.zeros(padded_vocab_size, weight.shape[1], dtype=weight.dtype)
        state[ours][:weight.shape[0]] = weight
    for i in range(shape.layers):
        for ours, (q, k, v) in _qkv(target, i):
            state[ours] = torch.cat([tensors[q].view(groups, per_group, channels, h),
                                     tensors[k].view(groups, 1, channels, h),
                                     tensors[v].view(groups, 1, channels, h)],
                                    dim=1).reshape(-1, h)
        for ours, parts, _ in _fc1s(shape, target, i):
            state[ours] = torch.cat([tensors[name] for name in parts])
        for name, size in target.zeros(shape, i).items():
            tensor = tensors.get(_layer(i) + name)
            if tensor is not None and (list(tensor.shape) != list(size) or tensor.any()):
                raise NotExportable(
                    f"{_layer(i) + name} (shape {list(tensor.shape)}) is not zero: the "
                    f"project's model has no such tensor")
    return state


def hf_names(shape: Shape, target: Target, with_zeros: bool = True) -> set:
    """Every tensor name a target's directory for this shape holds (with_zeros: also those of
    the tensors the project's model lacks, which an import may go without)."""
    names = {theirs for _, theirs in _renames(shape, target) + _vocabulary(shape)}
    for i in range(shape.layers):
        names |= {name for _, parts in _qkv(target, i) for name in parts}
        names |= {name for _, parts, _ in _fc1s(shape, target, i) for name in parts}
        if with_zeros:
            names |= {_layer(i) + name for name in target.zeros(shape, i)}
    return names
