"""MoE BERT as safetensors and a config, and back: no Hugging Face class expresses it.

An MoE BERT (megatron-core's BertModel with MoE layers) has no transformers counterpart, so
`--loader parm --saver hf` writes it as a plain, documented directory instead:

    config.json        {"model_type": "parm_trainer_bert_moe", "parm_trainer_version": ...,
                        "model_flags": {attribute: value}, "vocab_size": ...}
    model.safetensors  every tensor of the model on one rank (whole), under megatron-core's
                       names: embedding.{word,position,tokentype}_embeddings.weight,
                       encoder.layers.N.{input_layernorm, self_attention.linear_qkv,
                       self_attention.linear_proj, pre_mlp_layernorm, mlp.router,
                       mlp.experts.local_experts.E.linear_fc1, ...linear_fc2}.{weight,bias},
                       encoder.final_layernorm.*, lm_head.{dense,layer_norm}.*,
                       output_layer.bias, pooler.dense.*, binary_head.* (QKV rows grouped per
                       head as [q; k; v]; with --swiglu, fc1 is [gate; up])
    tokenizer.model    the SentencePiece model (and tokenizer.json for AutoTokenizer)

`--loader hf --saver parm` reads such a directory back into a checkpoint that
pretrain_bert_moe.py loads under any layout.
"""

from __future__ import annotations

import json
import os
import shutil

FORMAT = "parm_trainer_bert_moe"


def bert_flags(args: dict) -> dict:
    """The attributes of run.json's args that define an MoE BERT."""
    from parm_trainer.arguments import model_argument_names

    names = model_argument_names() | {"bert_binary_head", "padded_vocab_size", "model_family"}
    return {name: args[name] for name in sorted(names) if name in args}


def export_bert(model, description: dict, tokenizer: str, out: str) -> None:
    """Write the one-rank BERT `model` (loaded from the checkpoint run.json describes)."""
    import parm_trainer
    from safetensors.torch import save_file

    from parm_trainer.convert.hf_tokenizer import save_hf_tokenizer

    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
             if "_extra_state" not in k}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": FORMAT, "parm_trainer_version": parm_trainer.__version__,
              "model_flags": bert_flags(description["args"])}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_hf_tokenizer(tokenizer, out)
    shutil.copyfile(tokenizer, os.path.join(out, "tokenizer.model"))


def bert_model_args(config: dict, tokenizer_model: str):
    from parm_trainer.convert.single_process import one_rank_args

    return one_rank_args(config["model_flags"], tokenizer_model=tokenizer_model,
                         model_family="bert")
