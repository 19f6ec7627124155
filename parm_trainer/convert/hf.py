"""Export a GPT-MoE checkpoint to a Hugging Face directory, and import one back, streaming.

    export_to_hf("runs/demo/checkpoints", "runs/demo/hf")       # any layout in, one process
    import_from_hf("runs/demo/hf", "runs/imported")             # a checkpoint any layout loads

The class is chosen from the model's flags (families.py): MixtralForCausalLM where Mixtral
expresses the model (every layer MoE, megatron's default router), else Qwen2MoeForCausalLM
(--moe-router-pre-softmax, dense layers between the MoE layers, QKV biases, a shared expert),
Qwen3MoeForCausalLM (--qk-layernorm), OlmoeForCausalLM (--qk-layernorm-across-heads) or
DeepseekV3ForCausalLM (--multi-latent-attention); import goes by config.json's model_type.
BERT checkpoints go through hf_bert.py.

Neither holds the model: the project's model is built on the meta device (every tensor's name,
shape and place in a checkpoint, no data). An import makes each checkpoint tensor from the
Hugging Face tensors its rule (decoder.py) names when the checkpoint writer writes it
(stream_checkpoint.LazySave), reading them one at a time from the shards
model.safetensors.index.json names; an export reads the checkpoint a layer at a time
(stream_checkpoint.CheckpointReader) and writes shards of at most max_shard_size with their index
(hf_files.ShardWriter). The tokenizer travels along (tokenizer_files.py). Both write into
SAVE_DIR.partial and rename it to SAVE_DIR only when everything is written (output.py).
"""

from __future__ import annotations

import json
import os

from parm_trainer.convert.bert import FORMAT as BERT_FORMAT
from parm_trainer.convert.decoder import (check_copies, check_exportable, check_zeros, hf_names,
                                          legacy_keys, rules, shape_of_args, to_hf)
from parm_trainer.convert.families import TARGETS, target_of
from parm_trainer.convert.output import ConvertError, refuse_existing, written_whole
from parm_trainer.convert.single_process import latest
from parm_trainer.convert import tokenizer_files
from parm_trainer.training.checkpoint import files

__all__ = ["ConvertError", "DEFAULT_MAX_SHARD_SIZE", "export_to_hf", "import_from_hf"]
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default


def export_to_hf(load_dir: str, save_dir: str,
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> str:
    """Write the Hugging Face directory; returns the class it holds."""
    from parm_trainer.convert.output import parse_size

    max_bytes = parse_size(max_shard_size)
    refuse_existing(save_dir)
    path = latest(load_dir)
    description = files.read_description(path)
    args = description["args"]
    kind = tokenizer_files.exported_kind(args, load_dir)
    if description.get("model", "gpt") == "bert":
        if kind != tokenizer_files.SENTENCEPIECE:
            raise ConvertError(f"--load-dir {load_dir}: a BERT exports with a SentencePiece "
                               f"tokenizer only")
        from parm_trainer.convert.hf_bert import export_bert_dir

        return export_bert_dir(load_dir, save_dir, description)
    check_exportable(args)
    target = target_of(args)
    tokenizer = tokenizer_files.of_checkpoint(path, args)
    import transformers  # after the checks: a refusal is instant

    vocab = args.get("hf_vocab_size") or tokenizer.size
    with written_whole(save_dir) as out:
        from parm_trainer.convert.single_process import build_one_rank_model, close, one_rank_args

        try:
            model = build_one_rank_model(one_rank_args(args), meta=True)
            _check_fits(model, path, load_dir)
            _write_weights(model, path, shape_of_args(args), target.TARGET, vocab, out, max_bytes)
        finally:
            close()
        tokenizer_files.export(tokenizer, out)
        config = getattr(transformers, target.CONFIG_CLASS)
        fields = {**target.hf_config(args, vocab, tokenizer.bos, tokenizer.eos),
                  "dtype": trained_dtype(args)}  # the weights' dtype (a bf16 run's: bf16)
        config(architectures=[target.TARGET.class_name], **fields).save_pretrained(out)
        _add_to_json(os.path.join(out, "config.json"), legacy_keys(args))
        transformers.GenerationConfig(bos_token_id=tokenizer.bos, eos_token_id=tokenizer.eos,
                                      pad_token_id=tokenizer.pad).save_pretrained(out)
    return target.TARGET.class_name


def trained_dtype(args: dict) -> str:
    """config.json's dtype: what the run trained its weights in (--bf16, --fp16, else fp32)."""
    return "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32"


def _check_fits(model, path: str, load_dir: str) -> None:
    """The checkpoint's tensors are the model's (names and shapes), as a training load checks."""
    from parm_trainer.training.checkpoint.load import _misfit

    problem = _misfit({"model": model.sharded_state_dict()}, path)
    if problem:
        raise ConvertError(f"--load-dir {load_dir} does not fit the model its run.json "
                           f"describes: {problem}")


def _uncovered(model, every_rule: list) -> None:
    from parm_trainer.convert.stream_checkpoint import tensors_of

    missing = sorted(set(tensors_of(model)) - {rule.ours for rule in every_rule})
    if missing:
        raise ConvertError(f"no Hugging Face tensor gives the model's {missing[0]} "
                           f"({len(missing)} such)")


def _write_weights(model, path: str, shape, target, vocab: int, out: str, max_bytes: int):
    """The Hugging Face tensors, a part of the model read at a time (a layer's tensors up to a
    quarter shard), into shards of at most max_bytes."""
    from parm_trainer.convert.hf_files import ShardWriter
    from parm_trainer.convert.stream_checkpoint import CheckpointReader, parts, tensors_of

    _uncovered(model, rules(shape, target))
    meta, pieces, seen = tensors_of(model), [], set()
    for layer, names in parts(model, max_bytes // 4):
        pieces.append((names, [] if layer is None or layer in seen else [layer]))
        seen.add(layer)
    reader = CheckpointReader(path, model)
    stored = reader.stored_dtypes()  # each tensor written in the dtype the checkpoint holds

    def as_stored(tensors: dict) -> dict:
        return {n: t.to(stored[n]) if n in stored else t for n, t in tensors.items()}

    plan = [(name, list(tensor.shape), tensor.dtype) for names, zeros_of in pieces
            for name, tensor in to_hf(as_stored({n: meta[n] for n in names}), shape, target,
                                      vocab, zeros_of).items()]
    writer = ShardWriter(out, plan, max_bytes)
    for names, zeros_of in pieces:
        for name, tensor in to_hf(as_stored(reader.read(names)), shape, target, vocab,
                                  zeros_of).items():
            writer.write(name, tensor)
    writer.close()


def _add_to_json(path: str, entries: dict) -> None:
    with open(path) as f:
        content = json.load(f)
    with open(path, "w") as f:
        json.dump({**content, **entries}, f, indent=2, sort_keys=True)
        f.write("\n")


def import_from_hf(load_dir: str, save_dir: str, tokenizer_model: str | None = None,
                   tokenizer_type: str | None = None) -> tuple:
    """Write a weights-only checkpoint (iteration 0) of a Mixtral, Qwen2-MoE (in the form
    qwen2_moe.py writes), Qwen3-MoE, OLMoE, DeepSeek-V3 or convert/bert.py directory;
    returns (the entry script, the flags that build its model and load the checkpoint)."""
    refuse_existing(save_dir)
    config_file = os.path.join(load_dir, "config.json")
    if not os.path.isfile(config_file):
        raise ConvertError(f"--load-dir {load_dir} is not a Hugging Face model directory "
                           f"(no config.json)")
    config = json.load(open(config_file))
    if config.get("model_type") == BERT_FORMAT:
        from parm_trainer.convert.hf_bert import import_bert_dir

        return import_bert_dir(load_dir, save_dir, config, tokenizer_model)
    if config.get("model_type") not in TARGETS:
        raise ConvertError(f"config.json has model_type {config.get('model_type')!r}; only "
                           + ", ".join(f"{name!r} ({module.TARGET.class_name})"
                                       for name, module in TARGETS.items()) + " import")
    target = TARGETS[config["model_type"]]
    values = target.model_flags(config)
    tokenizer = tokenizer_files.choose(load_dir, tokenizer_model, tokenizer_type)
    hf_vocab = config["vocab_size"]
    padded, multiple = tokenizer_files.padded_rows(tokenizer, hf_vocab)
    if multiple != 128:  # Megatron-LM's default, left off the command line
        values["make_vocab_size_divisible_by"] = multiple
    from parm_trainer.convert.hf_files import Weights

    weights = Weights(load_dir)
    if not weights.file:
        raise ConvertError(f"--load-dir {load_dir} has no *.safetensors weights")
    if hasattr(target, "weight_flags"):  # what only the files say (DeepSeek-V3's MTP layers)
        values.update(target.weight_flags(config, weights.file))
    from parm_trainer.arguments import command_line
    from parm_trainer.convert.single_process import build_one_rank_model, close, one_rank_args
    from parm_trainer.convert.stream_checkpoint import LazySave
    from parm_trainer.training import checkpoint

    with written_whole(save_dir) as out:
        args = one_rank_args(values, tokenizer_type=tokenizer.kind,
                             tokenizer_model=tokenizer.path, padded_vocab_size=padded,
                             hf_vocab_size=hf_vocab)
        args.tokenizer = tokenizer.loaded  # a HuggingFaceTokenizer's copy is saved from it
        try:
            model = build_one_rank_model(args, meta=True)
            make = _source(model, weights, shape_of_args(values), target.TARGET, hf_vocab,
                           padded, load_dir, _reader(target, weights, config))
            checkpoint.save_checkpoint(out, 0, [model], None, None, 0, args,
                                       sharded_strategy=LazySave(model, make))
        finally:
            close()
    copy = f"{save_dir}/iter_0000000/{files.tokenizer_copy(tokenizer.kind, 'tokenizer_model')}"
    kind = [] if tokenizer.kind == "SentencePieceTokenizer" else [
        f"--tokenizer-type {tokenizer.kind}"]
    return "pretrain_gpt_moe.py", command_line(values) + kind + [
        f"--tokenizer-model {copy}", f"--load {save_dir}"]


def _reader(family, weights, config: dict):
    """name -> the directory's tensor as the family's rules take it (a family's hf_tensor(name,
    tensor, config) where it has one, e.g. DeepSeek-V3's rotary rows reordered)."""
    hook = getattr(family, "hf_tensor", None)
    if hook is None:
        return weights.read
    return lambda name: hook(name, weights.read(name), config)


def _source(model, weights, shape, target, hf_vocab: int, padded: int, load_dir: str, read):
    """name -> the model's tensor made from the directory's (read: name -> its tensor), once
    the directory is checked:
    every tensor the model needs present and of the right shape, none unused, the ones the
    model lacks zero. Only those zeros are read here."""
    from parm_trainer.convert.stream_checkpoint import tensors_of

    every_rule = rules(shape, target, padded_vocab_size=padded)
    _uncovered(model, every_rule)
    absent = sorted(hf_names(shape, target, with_zeros=False) - set(weights.file))
    if absent:
        raise ConvertError(f"{load_dir} has no tensor {absent[0]} ({len(absent)} such): the "
                           f"weights do not fit config.json")
    unused = sorted(set(weights.file) - hf_names(shape, target) - {"lm_head.weight"})
    if unused:
        raise ConvertError(f"the Hugging Face tensor {unused[0]} has no place in the model "
                           f"({len(unused)} such)")
    for name, tensor in to_hf(tensors_of(model), shape, target, hf_vocab).items():
        if name in weights and weights.shapes[name] != list(tensor.shape):
            raise ConvertError(f"{name}: {load_dir} gives shape {weights.shapes[name]}, the "
                               f"model has {list(tensor.shape)}")
    check_zeros(weights.read, weights.file, shape, target)
    check_copies(weights.read, weights.file, shape, target)
    by_ours = {rule.ours: rule for rule in every_rule}

    def make(name: str):
        rule = by_ours[name]
        return rule.merge([read(theirs) for theirs in rule.theirs])
    return make
