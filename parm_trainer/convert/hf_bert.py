"""MoE BERT and MegatronBert to and from Hugging Face directories, whole in one process.

A BERT without MoE layers exports as MegatronBertForPreTraining (or ...ForMaskedLM without the
binary head); an MoE BERT in convert/bert.py's format, which imports back tensor by tensor.
"""

from __future__ import annotations

import glob
import os
import shutil

import sentencepiece

from parm_trainer.convert.hf_tokenizer import save_hf_tokenizer
from parm_trainer.convert.output import ConvertError, written_whole
from parm_trainer.convert.single_process import load_one_rank
from parm_trainer.training.checkpoint import files


def export_bert_dir(load_dir: str, save_dir: str, description: dict) -> str:
    """A BERT without MoE layers -> MegatronBert; an MoE BERT -> convert/bert.py's format."""
    from parm_trainer.convert import megatron_bert
    from parm_trainer.convert.bert import export_bert
    from parm_trainer.convert.single_process import close

    args = description["args"]
    dense = not args.get("num_experts")
    if dense:
        megatron_bert.check_exportable(args)
    with written_whole(save_dir) as out:
        model, tokenizer = load_one_rank(load_dir)
        try:
            if dense:
                written = _write_megatron_bert(model, args, tokenizer, out)
            else:
                export_bert(model, description, tokenizer, out)
                written = "MoE BERT safetensors (convert/bert.py's format)"
        finally:
            close()
    return written


def _write_megatron_bert(model, args: dict, tokenizer: str, out: str) -> str:
    from safetensors.torch import save_file
    from transformers import MegatronBertConfig

    from parm_trainer.convert import megatron_bert

    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer)
    state = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    save_file(megatron_bert.to_hf(state, args, sp.vocab_size()),
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    head = "MegatronBertForPreTraining" if args["bert_binary_head"] else "MegatronBertForMaskedLM"
    MegatronBertConfig(architectures=[head], **megatron_bert.hf_config(
        args, sp.vocab_size(), max(sp.pad_id(), 0))).save_pretrained(out)
    save_hf_tokenizer(tokenizer, out)
    shutil.copyfile(tokenizer, os.path.join(out, "tokenizer.model"))
    return head


def _read_safetensors(load_dir: str) -> dict:
    from safetensors import safe_open

    paths = sorted(glob.glob(os.path.join(load_dir, "*.safetensors")))
    if not paths:
        raise ConvertError(f"--load-dir {load_dir} has no *.safetensors weights")
    tensors = {}
    for file in paths:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def import_bert_dir(load_dir: str, save_dir: str, config: dict, tokenizer_model) -> tuple:
    """An MoE BERT directory (convert/bert.py) back into a checkpoint: every tensor by name."""
    from parm_trainer.arguments import add_bert_args, command_line
    from parm_trainer.convert.bert import bert_model_args
    from parm_trainer.convert.single_process import build_one_rank_model, close
    from parm_trainer.training import checkpoint

    tokenizer_model = tokenizer_model or os.path.join(load_dir, "tokenizer.model")
    tensors = _read_safetensors(load_dir)
    with written_whole(save_dir) as out:
        args = bert_model_args(config, tokenizer_model)
        model = build_one_rank_model(args)
        try:
            own = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
            for ours, theirs in ((own, tensors), (tensors, own)):
                missing = sorted(set(ours) - set(theirs))
                if missing:
                    side = "the directory" if theirs is tensors else "the model"
                    raise ConvertError(f"{missing[0]} is not in {side} ({len(missing)} such)")
            _copy_into(own, tensors, "the directory")
            checkpoint.save_checkpoint(out, 0, [model], None, None, 0, args)
        finally:
            close()
    flags = {k: v for k, v in config["model_flags"].items() if k != "padded_vocab_size"}
    return "pretrain_bert_moe.py", command_line(flags, add_bert_args) + [
        f"--tokenizer-model {save_dir}/iter_0000000/{files.TOKENIZER}", f"--load {save_dir}"]


def _copy_into(own: dict, state: dict, source: str) -> None:
    import torch

    with torch.no_grad():
        for key, value in state.items():
            if own[key].shape != value.shape:
                raise ConvertError(f"{key}: {source} gives shape {list(value.shape)}, the model "
                                   f"has {list(own[key].shape)}")
            own[key].copy_(value)
