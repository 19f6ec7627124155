"""The project's GPT-MoE decoder <-> a Hugging Face decoder class, tensor by tensor.

The project's side is the state dict of its model built on one rank (TP = EP = PP = 1, so every
tensor is whole): megatron-core's local layer names. The Hugging Face side is a Target
(mixtral.py, qwen2_moe.py, qwen3_moe.py, olmoe.py): the names of one class, in the per-expert form
(`...experts.N.<projection>.weight`) that transformers 4.x loads as it is and 5.x converts on
load (and writes itself in save_pretrained).

The map is data: rules() lists every tensor of the project's model as a Rule, its name, the
Hugging Face names it is made of, and a split and a merge between them; zeros() lists the
Hugging Face tensors the model lacks. to_hf applies the rules to a state dict (or a part of
one); the import (hf.py) applies them one tensor at a time. Three rules
are not renames:
- attention: megatron keeps one fused QKV weight, grouped per key/value head: for each of the g
  groups, its n/g query heads, then its key head, then its value head (d rows each); Hugging
  Face has separate q_proj, k_proj, v_proj with heads in order (query head j uses key/value
  head j // (n/g), which is the same grouping);
  the QKV bias (--add-qkv-bias) is grouped the same way;
- SwiGLU MLPs (experts, dense layers, a shared expert): megatron's fc1 is [gate; up] (the first
  half goes through SiLU), Hugging Face has the gate and the up projection apart; fc2 is the
  down one;
- the embedding (and an untied output layer): the project pads its rows with zeros past the
  Hugging Face vocabulary.
The query/key norms (--qk-layernorm: the Target's qk_norm names) are renames. The project's
multi-token prediction layer j (--mtp-num-layers) is Hugging Face's layer L + j: its transformer
layer has a decoder layer's rules, its own tensors the Target's mtp Rules, and the tensors a
class repeats there (the Target's copies) are written as copies and refused unless equal. A Target with an
attention of its own (DeepSeek-V3's multi-latent attention) gives that attention's Rules in
place of the fused QKV, its bias and the query/key norms; one with more tensors in a layer
(Qwen2-MoE's shared expert and its sigmoid gate, DeepSeek-V3's expert bias and shared experts)
gives them as extra Rules. A Target may also have tensors the project's model does not (a
Qwen2-MoE or DeepSeek-V3 without a shared expert: one of width 0; the output projection's bias
where a class has QKV biases only with it): they are written as zeros of the right shape, so
the function is the same, and an import refuses them unless they are zero.
"""

from __future__ import annotations

import dataclasses
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
CLASSES = ("MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM or "
           "DeepseekV3ForCausalLM")


def check_exportable(args: dict) -> None:
    if not args.get("num_experts"):
        raise NotExportable(f"the model has no MoE layers (--num-experts): each of "
                            f"{CLASSES} needs them")
    if args.get("mtp_num_layers") and not args.get("multi_latent_attention"):
        raise NotExportable(f"--mtp-num-layers {args['mtp_num_layers']}: of {CLASSES} only "
                            f"DeepseekV3ForCausalLM (--multi-latent-attention) has multi-token "
                            f"prediction layers")
    for flag, (needed, fix) in REQUIRED.items():
        if args.get(flag) != needed:
            raise NotExportable(
                f"--{flag.replace('_', '-')} is {args.get(flag)!r}: none of {CLASSES} can "
                f"express it; a model trained with {fix} exports")


# megatron's router options a softmax router (Mixtral's, Qwen2/3-MoE's, OLMoE's) has not:
# (flag, its default)
ROUTER_DEFAULTS = (("moe_router_score_function", "softmax"),
                   ("moe_router_enable_expert_bias", False),
                   ("moe_router_topk_scaling_factor", None), ("moe_router_num_groups", None))


def softmax_router_problem(args: dict, class_name: str):
    """Why a class with a softmax router cannot express run.json's router (None where it
    can): sigmoid scores, the expert bias, a scaling factor or groups are DeepSeek-V3's."""
    for flag, default in ROUTER_DEFAULTS:
        if args.get(flag, default) != default:
            return (f"--{flag.replace('_', '-')} {args[flag]!r}: {class_name}'s router has the "
                    f"softmax score, no bias, scale or groups (DeepseekV3ForCausalLM's has "
                    f"them, with --multi-latent-attention)")
    return None


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
    without it 4.x takes its default base of 1e6), and Qwen3-MoE's experts from num_experts
    (5.x writes num_local_experts; every class here reads num_experts as the same number)."""
    return {"rope_theta": float(args["rotary_base"]), "num_experts": args["num_experts"]}


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
    if config.get("hidden_act", "silu") != "silu":
        raise NotExportable(f"hidden_act {config['hidden_act']!r}: the project's SwiGLU is "
                            f"SiLU's (--swiglu); only silu imports")
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


def experts_of(config: dict) -> int:
    """The experts per MoE layer (num_experts, or num_local_experts as 5.x writes some)."""
    return config.get("num_experts") or config["num_local_experts"]


def router_flags(config: dict) -> dict:
    """--moe-router-pre-softmax of norm_topk_prob (softmax over all experts, the top k's
    probabilities renormalised or not; megatron's default router is the renormalised one)."""
    pre_softmax = not config.get("norm_topk_prob", False)
    if config["num_experts_per_tok"] == 1 and not pre_softmax:
        raise NotExportable("num_experts_per_tok 1 with norm_topk_prob true (every routing "
                            "weight 1): the project's top-1 router is the pre-softmax one")
    return {"moe_router_pre_softmax": pre_softmax}


def no_sliding_window(config: dict) -> None:
    if config.get("use_sliding_window"):
        raise NotExportable("use_sliding_window true: attention over a window is not "
                            "supported; only full causal attention imports")


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
    moe: tuple  # per layer, the MTP layers' last: is it an MoE layer
    qkv_bias: bool = False
    qk_norm: bool = False  # per head (--qk-layernorm) or over all heads: the same names
    shared_ffn: int = 0  # the shared expert's width (0: none)
    shared_gate: bool = False
    expert_bias: bool = False  # the router's aux-loss-free bias
    q_lora_rank: Optional[int] = None  # multi-latent attention's query latent (None: none)
    # multi-token prediction layers (--mtp-num-layers) after the decoder's, each of the last
    # decoder layer's kind: Hugging Face's layers `layers` and on (DeepSeek-V3's)
    mtp: int = 0

    @property
    def layers(self) -> int:
        """The decoder's layers (the MTP layers not counted)."""
        return len(self.moe) - self.mtp


def shape_of_args(args: dict) -> Shape:
    pattern = moe_layer_pattern(args.get("moe_layer_freq") or 1, args["num_layers"])
    mtp = args.get("mtp_num_layers") or 0
    return Shape(args["hidden_size"], *heads(args), args["num_experts"],
                 args["moe_ffn_hidden_size"], args.get("ffn_hidden_size") or 0,
                 not args["untie_embeddings_and_output_weights"],
                 tuple(bool(moe) for moe in pattern + pattern[-1:] * mtp), mtp=mtp,
                 qkv_bias=bool(args.get("add_qkv_bias")), qk_norm=bool(args.get("qk_layernorm")),
                 shared_ffn=args.get("moe_shared_expert_intermediate_size") or 0,
                 shared_gate=bool(args.get("moe_shared_expert_gate")),
                 expert_bias=bool(args.get("moe_router_enable_expert_bias")),
                 q_lora_rank=args.get("q_lora_rank"))


@dataclass(frozen=True)
class Target:
    """One Hugging Face class's names (layer i's prefix is model.layers.{i}.)."""
    class_name: str
    router: str  # the router's weight, under the layer
    expert: Callable  # e -> (gate, up, down) names under the layer
    dense: tuple  # (gate, up, down) of a dense layer's MLP, under the layer
    zeros: Callable  # (shape, layer index) -> {name: tensor shape}: what the model lacks
    # (shape, layer index) -> more Rules of that layer: tensors only some classes have
    extra: Callable = lambda shape, i: ()
    qk_norm: tuple = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # under the layer
    # (shape, layer index) -> the Rules of that layer's attention in place of megatron's fused
    # QKV <-> q_proj, k_proj, v_proj, its bias and the query/key norms (None: those)
    attention: Optional[Callable] = None
    # (shape, MTP layer j) -> the Rules of its tensors beside its transformer layer (whose are
    # a decoder layer's at Hugging Face's layer shape.layers + j)
    mtp: Callable = lambda shape, j: ()
    # shape -> {name: the name it is a copy of}: Hugging Face tensors that repeat another
    # (DeepSeek-V3's MTP layers' embedding and head), written as copies, refused unless equal
    copies: Callable = lambda shape: {}


@dataclass(frozen=True)
class Rule:
    """One tensor of the project's model and the Hugging Face tensors it is made of, read
    both ways: split(ours) gives theirs in order, merge([theirs in order]) gives ours."""
    ours: str
    theirs: tuple
    split: Callable
    merge: Callable


def _layer(i: int) -> str:
    return f"model.layers.{i}."


def layer_of(name: str):
    """The layer index of a name on either side (decoder.layers.{i}. or model.layers.{i}.),
    ("mtp", j) for the project's MTP layer j (mtp.layers.{j}.), else None (embedding, final
    norm, output layer)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        return ("mtp", int(parts[2])) if parts[0] == "mtp" else int(parts[2])
    return None


def hf_layer(shape: Shape, layer) -> int:
    """Hugging Face's layer index of layer_of's answer (MTP layer j: shape.layers + j)."""
    return shape.layers + layer[1] if isinstance(layer, tuple) else layer


def same(ours: str, theirs: str) -> Rule:
    return Rule(ours, (theirs,), lambda t: (t,), lambda ts: ts[0])


def _rows(ours: str, theirs: str, vocab_size, padded_vocab_size) -> Rule:
    """Embedding rows: Hugging Face holds the vocabulary's, the project pads them (zeros) for
    tensor parallelism."""
    def merge(ts):
        import torch

        padded = torch.zeros(padded_vocab_size, ts[0].shape[1], dtype=ts[0].dtype,
                             device=ts[0].device)
        padded[:ts[0].shape[0]] = ts[0]
        return padded
    return Rule(ours, (theirs,), lambda t: (t[:vocab_size],), merge)


def _qkv(shape: Shape, i: int, kind: str = "weight") -> Rule:
    """megatron's fused QKV weight or bias, grouped per key/value head <-> q_proj, k_proj,
    v_proj (a weight's rows have h columns, a bias's none)."""
    import torch

    groups, channels = shape.groups, shape.channels
    per_group = shape.heads // groups
    attention = _layer(i) + "self_attn."

    def split(t):
        columns = t.shape[1:]
        qkv = t.view(groups, per_group + 2, channels, *columns)
        return (qkv[:, :per_group].reshape(-1, *columns), qkv[:, per_group].reshape(-1, *columns),
                qkv[:, per_group + 1].reshape(-1, *columns))

    def merge(ts):
        q, k, v = ts
        columns = q.shape[1:]
        return torch.cat([q.view(groups, per_group, channels, *columns),
                          k.view(groups, 1, channels, *columns),
                          v.view(groups, 1, channels, *columns)], dim=1).reshape(-1, *columns)
    return Rule(f"decoder.layers.{i}.self_attention.linear_qkv.{kind}",
                tuple(attention + f"{p}_proj.{kind}" for p in "qkv"), split, merge)


def _attention(shape: Shape, target: Target, i: int) -> list:
    """Layer i's QKV weight, its bias (--add-qkv-bias) and the query/key norms
    (--qk-layernorm)."""
    ours, theirs = f"decoder.layers.{i}.self_attention.", _layer(i)
    out = [_qkv(shape, i)] + ([_qkv(shape, i, "bias")] if shape.qkv_bias else [])
    if shape.qk_norm:
        out += [same(f"{ours}{p}_layernorm.weight", theirs + name)
                for p, name in zip("qk", target.qk_norm)]
    return out


def glu(ours: str, gate: str, up: str) -> Rule:
    """A SwiGLU fc1, [gate; up] in megatron, the two projections apart in Hugging Face."""
    import torch

    def split(t):
        rows = t.shape[0] // 2
        return t[:rows], t[rows:]
    return Rule(ours, (gate, up), split, lambda ts: torch.cat(list(ts)))


def rules(shape: Shape, target: Target, vocab_size=None, padded_vocab_size=None) -> list:
    """Every tensor of the project's model as a Rule, the embedding first, then layer by layer,
    then the final norm and the output layer. vocab_size (the Hugging Face embedding's rows)
    is what split needs, padded_vocab_size what merge needs."""
    out = [_rows("embedding.word_embeddings.weight", "model.embed_tokens.weight", vocab_size,
                 padded_vocab_size)]
    for i in range(shape.layers):
        out += _layer_rules(shape, target, i)
    out.append(same("decoder.final_layernorm.weight", "model.norm.weight"))
    if not shape.tied:
        out.append(_rows("output_layer.weight", "lm_head.weight", vocab_size, padded_vocab_size))
    for j in range(shape.mtp):  # megatron's MTP layer j: a transformer layer and more
        decoder, ours = f"decoder.layers.{shape.layers + j}.", f"mtp.layers.{j}.transformer_layer."
        out += [dataclasses.replace(rule, ours=ours + rule.ours[len(decoder):])
                for rule in _layer_rules(shape, target, shape.layers + j)]
        out += list(target.mtp(shape, j))
    return out


def _layer_rules(shape: Shape, target: Target, i: int) -> list:
    """The Rules of decoder layer i (of Hugging Face's layer i)."""
    ours, theirs = f"decoder.layers.{i}.", _layer(i)
    out = [same(ours + "input_layernorm.weight", theirs + "input_layernorm.weight"),
           *(target.attention(shape, i) if target.attention else _attention(shape, target, i)),
           same(ours + "self_attention.linear_proj.weight", theirs + "self_attn.o_proj.weight"),
           same(ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight")]
    if shape.moe[i]:
        out.append(same(ours + "mlp.router.weight", theirs + target.router))
        for e in range(shape.experts):
            gate, up, down = (theirs + name for name in target.expert(e))
            expert = f"{ours}mlp.experts.local_experts.{e}."
            out += [glu(expert + "linear_fc1.weight", gate, up),
                    same(expert + "linear_fc2.weight", down)]
    else:
        gate, up, down = (theirs + name for name in target.dense)
        out += [glu(ours + "mlp.linear_fc1.weight", gate, up),
                same(ours + "mlp.linear_fc2.weight", down)]
    return out + list(target.extra(shape, i))


def zeros(shape: Shape, target: Target, layers=None) -> dict:
    """The Hugging Face tensors the project's model lacks (written as zeros, refused on import
    unless zero): name -> shape, for the given layers (layer_of's answers; all by default)."""
    indices = range(len(shape.moe)) if layers is None else [hf_layer(shape, i) for i in layers]
    return {_layer(i) + name: size for i in indices
            for name, size in target.zeros(shape, i).items()}


def check_zeros(read: Callable, present, shape: Shape, target: Target) -> None:
    """Refuse, by name, a tensor the model lacks that is not zero (read: name -> tensor; only
    the names present are read)."""
    for name, size in zeros(shape, target).items():
        if name not in present:
            continue
        tensor = read(name)
        if list(tensor.shape) != list(size) or tensor.any():
            raise NotExportable(f"{name} (shape {list(tensor.shape)}) is not zero: the "
                                f"project's model has no such tensor")


def check_copies(read: Callable, present, shape: Shape, target: Target) -> None:
    """Refuse, by name, a Hugging Face tensor that should repeat another and does not (the
    project's model holds it once; read: name -> tensor; only the names present are read)."""
    import torch

    for copy, original in target.copies(shape).items():
        if copy in present and original in present and not torch.equal(read(copy),
                                                                        read(original)):
            raise NotExportable(f"{copy} differs from {original}: the project's model holds "
                                f"them as one tensor")


def to_hf(state: dict, shape: Shape, target: Target, vocab_size: int, zeros_of=None) -> dict:
    """The target's tensors (the first vocab_size embedding rows) of a one-rank state dict, or
    of a part of one: the rules whose tensor it holds, and the zeros of the layers zeros_of
    names (by default those it holds a tensor of). Views of state's tensors where they can be."""
    import torch

    out = {}
    for rule in rules(shape, target, vocab_size=vocab_size):
        if rule.ours in state:
            out.update(zip(rule.theirs, rule.split(state[rule.ours])))
    out.update({copy: out[original] for copy, original in target.copies(shape).items()
                if original in out})
    like = next(iter(state.values()))
    held = {layer_of(name) for name in state} - {None} if zeros_of is None else zeros_of
    for name, size in zeros(shape, target, sorted(held, key=lambda i: hf_layer(shape, i))).items():
        out[name] = torch.zeros(size, dtype=like.dtype, device=like.device)
    return {key: value.detach().contiguous() for key, value in out.items()}


def hf_names(shape: Shape, target: Target, with_zeros: bool = True) -> set:
    """Every tensor name a target's directory for this shape holds (with_zeros: also those of
    the tensors the project's model lacks, which an import may go without)."""
    names = {name for rule in rules(shape, target) for name in rule.theirs}
    names |= set(target.copies(shape))
    return names | set(zeros(shape, target)) if with_zeros else names
