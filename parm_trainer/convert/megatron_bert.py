"""A BERT without MoE layers -> Hugging Face MegatronBertForPreTraining (or ...ForMaskedLM).

megatron-core's BertModel and transformers' MegatronBert are the same network: learned
positions and token types with no embedding norm, pre-norm layers with LayerNorm and GELU, a
final norm, a tanh pooler on the first token, the masked-LM head (dense, GELU, LayerNorm, the
tied embedding plus a bias) and the two-way sentence head. The fused QKV rows are grouped per
head ([q; k; v] of d rows each). Biases absent under --disable-bias-linear are written as zeros.
"""

from __future__ import annotations

from parm_trainer.convert.decoder import NotExportable

_NEEDED = {"normalization": "LayerNorm", "swiglu": False,
           "position_embedding_type": "learned_absolute", "group_query_attention": False}


def check_exportable(args: dict) -> None:
    if args.get("num_experts"):
        raise NotExportable("an MoE BERT has no Hugging Face class; it exports as safetensors "
                            "and a config instead (see parm_trainer/convert/bert.py)")
    for flag, needed in _NEEDED.items():
        if args.get(flag, needed) != needed:
            raise NotExportable(f"--{flag.replace('_', '-')} is {args.get(flag)!r}: "
                                f"MegatronBert needs {needed!r}")
    if args.get("kv_channels") and args["kv_channels"] * args["num_attention_heads"] != \
            args["hidden_size"]:
        raise NotExportable("--kv-channels x heads differs from --hidden-size: MegatronBert "
                            "cannot express it")


def hf_config(args: dict, vocab_size: int, pad: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=args["hidden_size"],
                num_hidden_layers=args["num_layers"],
                num_attention_heads=args["num_attention_heads"],
                intermediate_size=args["ffn_hidden_size"], hidden_act="gelu",
                max_position_embeddings=args["max_position_embeddings"],
                type_vocab_size=2 if args["bert_binary_head"] else 1,
                layer_norm_eps=args["norm_epsilon"], pad_token_id=pad,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def to_hf(state: dict, args: dict, vocab_size: int) -> dict:
    import torch

    h, heads = args["hidden_size"], args["num_attention_heads"]
    d = h // heads

    def get(key, like=None):  # a bias the model does not have is zero
        return state[key] if key in state else torch.zeros(like)

    out = {"bert.embeddings.word_embeddings.weight":
           state["embedding.word_embeddings.weight"][:vocab_size],
           "bert.embeddings.position_embeddings.weight":
           state["embedding.position_embeddings.weight"],
           "bert.encoder.ln.weight": state["encoder.final_layernorm.weight"],
           "bert.encoder.ln.bias": state["encoder.final_layernorm.bias"],
           "cls.predictions.transform.dense.weight": state["lm_head.dense.weight"],
           "cls.predictions.transform.dense.bias": get("lm_head.dense.bias", h),
           "cls.predictions.transform.LayerNorm.weight": state["lm_head.layer_norm.weight"],
           "cls.predictions.transform.LayerNorm.bias": state["lm_head.layer_norm.bias"],
           "cls.predictions.bias": get("output_layer.bias", vocab_size)[:vocab_size]}
    out["bert.embeddings.token_type_embeddings.weight"] = (
        state["embedding.tokentype_embeddings.weight"] if args["bert_binary_head"]
        else torch.zeros(1, h))
    if args["bert_binary_head"]:
        out.update({"bert.pooler.dense.weight": state["pooler.dense.weight"],
                    "bert.pooler.dense.bias": get("pooler.dense.bias", h),
                    "cls.seq_relationship.weight": state["binary_head.weight"],
                    "cls.seq_relationship.bias": get("binary_head.bias", 2)})
    for i in range(args["num_layers"]):
        ours, theirs = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        qkv_w = state[ours + "self_attention.linear_qkv.weight"].view(heads, 3, d, h)
        qkv_b = get(ours + "self_attention.linear_qkv.bias", 3 * h).view(heads, 3, d)
        for j, name in enumerate(("query", "key", "value")):
            out[f"{theirs}attention.self.{name}.weight"] = qkv_w[:, j].reshape(h, h)
            out[f"{theirs}attention.self.{name}.bias"] = qkv_b[:, j].reshape(h)
        ffn = args["ffn_hidden_size"]
        for ours_name, theirs_name, size in (
                ("self_attention.linear_proj", "attention.output.dense", h),
                ("mlp.linear_fc1", "intermediate.dense", ffn),
                ("mlp.linear_fc2", "output.dense", h)):
            out[f"{theirs}{theirs_name}.weight"] = state[f"{ours}{ours_name}.weight"]
            out[f"{theirs}{theirs_name}.bias"] = get(f"{ours}{ours_name}.bias", size)
        for ours_name, theirs_name in (("input_layernorm", "attention.ln"),
                                       ("pre_mlp_layernorm", "ln")):
            out[f"{theirs}{theirs_name}.weight"] = state[f"{ours}{ours_name}.weight"]
            out[f"{theirs}{theirs_name}.bias"] = state[f"{ours}{ours_name}.bias"]
    return {key: value.detach().clone().contiguous() for key, value in out.items()}
