"""Export a GPT-MoE checkpoint to a Hugging Face directory, and import one back.

    export_to_hf("runs/demo/checkpoints", "runs/demo/hf")       # any layout in, one process
    import_from_hf("runs/demo/hf", "runs/imported")             # a checkpoint any layout loads

The class is MixtralForCausalLM where Mixtral expresses the model (every layer MoE, megatron's
default router), else Qwen2MoeForCausalLM (--moe-router-pre-softmax, dense layers between the
MoE layers), DeepseekV3ForCausalLM with multi-latent attention; see mixtral.py, qwen2_moe.py,
deepseek_v3.py.

Both write into SAVE_DIR.partial and rename it to SAVE_DIR only when everything is written, so
SAVE_DIR appears whole or not at all; an existing SAVE_DIR is refused before anything is done.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil

import sentencepiece

from parm_trainer.convert.bert import FORMAT as BERT_FORMAT
from parm_trainer.convert.hf_tokenizer import save_hf_tokenizer
from parm_trainer.convert import deepseek_v3, mixtral, qwen2_moe
from parm_trainer.convert.decoder import (check_exportable, from_hf, hf_names, legacy_keys,
                                          shape_of_args, to_hf)
from parm_trainer.training.checkpoint import files

# config.json's model_type -> module
TARGETS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "deepseek_v3": deepseek_v3}


class ConvertError(ValueError):
    """Input the converter cannot use; the message names it."""


def _refuse_existing(save_dir: str) -> None:
    if os.path.exists(save_dir):
        raise ConvertError(f"--save-dir {save_dir} exists; give a directory that does not")


@contextlib.contextmanager
def written_whole(save_dir: str):
    _refuse_existing(save_dir)
    partial = save_dir.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.rename(partial, save_dir)


def _latest(load_dir: str) -> str:
    try:
        return files.latest_dir(load_dir)
    except files.CheckpointError as error:
        raise ConvertError(f"--load-dir {error}") from None


def load_one_rank(load_dir: str, **overrides):
    """(model on one rank with the checkpoint's weights, its tokenizer file)."""
    path = _latest(load_dir)
    description = files.read_description(path)
    tokenizer = os.path.join(path, files.TOKENIZER)
    from parm_trainer.convert.single_process import build_one_rank_model, one_rank_args
    from parm_trainer.training import checkpoint  # torch, megatron-core: when needed

    args = one_rank_args(description["args"], tokenizer_model=tokenizer, **overrides)
    model = build_one_rank_model(args)
    checkpoint.load_checkpoint(load_dir, [model], None, None, load_optimizer=False,
                                  load_rng=False)
    return model, tokenizer


def target_of(args: dict):
    """The module (a TARGETS value) of the class that expresses run.json's model."""
    if args.get("multi_latent_attention"):
        return deepseek_v3
    return mixtral if mixtral.expresses(args) else qwen2_moe


def export_to_hf(load_dir: str, save_dir: str) -> str:
    """Write the Hugging Face directory; returns the class it holds."""
    _refuse_existing(save_dir)
    description = files.read_description(_latest(load_dir))
    args = description["args"]
    kind = args.get("tokenizer_type") or "SentencePieceTokenizer"
    if kind not in ("SentencePieceTokenizer", "Llama2Tokenizer"):  # no tokenizer.model
        raise ConvertError(f"--load-dir {load_dir} was trained with --tokenizer-type {kind}; "
                           f"the Hugging Face export carries SentencePiece tokenizers only")
    if description.get("model", "gpt") == "bert":
        return _export_bert(load_dir, save_dir, description)
    check_exportable(args)
    target = target_of(args)
    import transformers  # after the checks: a refusal is instant
    from safetensors.torch import save_file

    with written_whole(save_dir) as out:
        from parm_trainer.convert.single_process import close

        model, tokenizer = load_one_rank(load_dir)
        try:
            sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer)
            vocab = args.get("hf_vocab_size") or sp.vocab_size()
            state = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
            save_file(to_hf(state, shape_of_args(args), target.TARGET, vocab),
                      os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        finally:
            close()
        config = getattr(transformers, target.CONFIG_CLASS)
        config(architectures=[target.TARGET.class_name],
               **target.hf_config(args, vocab, sp.bos_id(), sp.eos_id())).save_pretrained(out)
        _add_to_json(os.path.join(out, "config.json"), legacy_keys(args))
        transformers.GenerationConfig(bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id(),
                         pad_token_id=max(sp.pad_id(), 0)).save_pretrained(out)
        save_hf_tokenizer(tokenizer, out)
        shutil.copyfile(tokenizer, os.path.join(out, "tokenizer.model"))  # for the way back
    return target.TARGET.class_name


def _add_to_json(path: str, entries: dict) -> None:
    with open(path) as f:
        content = json.load(f)
    with open(path, "w") as f:
        json.dump({**content, **entries}, f, indent=2, sort_keys=True)
        f.write("\n")


def _export_bert(load_dir: str, save_dir: str, description: dict) -> str:
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


def import_from_hf(load_dir: str, save_dir: str, tokenizer_model: str | None = None) -> tuple:
    """Write a weights-only checkpoint (iteration 0) of a Mixtral, Qwen2-MoE (in the form
    qwen2_moe.py writes) or convert/bert.py directory;
    returns (the entry script, the flags that build its model and load the checkpoint)."""
    _refuse_existing(save_dir)
    config_file = os.path.join(load_dir, "config.json")
    if not os.path.isfile(config_file):
        raise ConvertError(f"--load-dir {load_dir} is not a Hugging Face model directory "
                           f"(no config.json)")
    config = json.load(open(config_file))
    if config.get("model_type") == BERT_FORMAT:
        return _import_bert(load_dir, save_dir, config, tokenizer_model)
    if config.get("model_type") not in TARGETS:
        raise ConvertError(f"config.json has model_type {config.get('model_type')!r}; only "
                           + ", ".join(f"{name!r} ({module.TARGET.class_name})"
                                       for name, module in TARGETS.items()) + " import")
    target = TARGETS[config["model_type"]]
    values = target.model_flags(config)
    tokenizer_model = tokenizer_model or os.path.join(load_dir, "tokenizer.model")
    if not os.path.isfile(tokenizer_model):
        raise ConvertError(f"{load_dir} has no tokenizer.model (SentencePiece): give "
                           f"--tokenizer-model")
    from parm_trainer.arguments import command_line
    from parm_trainer.convert.single_process import build_one_rank_model, close, one_rank_args
    from parm_trainer.models.config import padded_vocab_size
    from parm_trainer.training import checkpoint

    try:
        sp_vocab = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model).vocab_size()
    except (RuntimeError, OSError) as error:  # "could not parse ModelProto"
        raise ConvertError(f"--tokenizer-model {tokenizer_model} is not a SentencePiece model "
                           f"({error})") from None
    hf_vocab = config["vocab_size"]
    padded = padded_vocab_size(sp_vocab, 1)
    if not sp_vocab <= hf_vocab <= padded:
        raise ConvertError(
            f"the tokenizer {tokenizer_model} has {sp_vocab} pieces and the model {hf_vocab} "
            f"embedding rows; they must agree up to the padding to {padded}")
    tensors = _read_safetensors(load_dir)
    tensors = getattr(target, "hf_tensors", lambda given, _: given)(tensors, config)
    with written_whole(save_dir) as out:
        args = one_rank_args(values, tokenizer_model=tokenizer_model,
                             padded_vocab_size=padded, hf_vocab_size=hf_vocab)
        model = build_one_rank_model(args)
        try:
            shape = shape_of_args(values)
            absent = sorted(hf_names(shape, target.TARGET, with_zeros=False) - set(tensors))
            if absent:
                raise ConvertError(f"{load_dir} has no tensor {absent[0]} ({len(absent)} "
                                   f"such): the weights do not fit config.json")
            _fill(model, from_hf(tensors, shape, target.TARGET, padded), tensors,
                  hf_names(shape, target.TARGET))
            checkpoint.save_checkpoint(out, 0, [model], None, None, 0, args)
        finally:
            close()
    return "pretrain_gpt_moe.py", command_line(values) + [
        f"--tokenizer-model {save_dir}/iter_0000000/{files.TOKENIZER}", f"--load {save_dir}"]


def _import_bert(load_dir: str, save_dir: str, config: dict, tokenizer_model) -> tuple:
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


def _fill(model, state: dict, tensors: dict, names: set) -> None:
    """Copy every tensor into the model: none of the model's may be left out, and no Hugging
    Face tensor may go unused (a bias, a shared expert: something the model cannot hold)."""
    own = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    missing = sorted(set(own) - set(state))
    if missing:
        raise ConvertError(f"no Hugging Face tensor gives the model's {missing[0]}")
    unused = sorted(set(tensors) - names - {"lm_head.weight"})
    if unused:
        raise ConvertError(f"the Hugging Face tensor {unused[0]} has no place in the model "
                           f"({len(unused)} such)")
    _copy_into(own, state, "Hugging Face")


def _copy_into(own: dict, state: dict, source: str) -> None:
    import torch

    with torch.no_grad():
        for key, value in state.items():
            if own[key].shape != value.shape:
                raise ConvertError(f"{key}: {source} gives shape {list(value.shape)}, the model "
                                   f"has {list(own[key].shape)}")
            own[key].copy_(value)
