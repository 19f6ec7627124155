"""Convert checkpoints between parm_trainer and Hugging Face transformers, in one process.

    # a GPT-MoE checkpoint of any layout -> a MixtralForCausalLM directory (Qwen2MoeForCausalLM
    # for --moe-router-pre-softmax or dense layers between the MoE layers, DeepseekV3ForCausalLM
    # with --multi-latent-attention)
    python tools/checkpoint/convert.py --loader parm --saver hf \\
        --load-dir runs/demo/checkpoints --save-dir runs/demo/hf
    # a Mixtral, DeepSeek-V3 (or such a Qwen2-MoE) directory -> a checkpoint that pretrain --load trains from
    python tools/checkpoint/convert.py --loader hf --saver parm \\
        --load-dir runs/demo/hf --save-dir runs/imported

Both stream: a layer (or a tensor) is in memory at a time, never the model, so a checkpoint
larger than memory converts; the export writes shards of at most --max-shard-size with
model.safetensors.index.json, the import reads such shards. The tokenizer travels along: a
directory's tokenizer.model (SentencePiece) or, where it has none, its tokenizer.json
(--tokenizer-type HuggingFaceTokenizer, Megatron-LM's; give the flag to take tokenizer.json
where both are); the export writes the checkpoint's tokenizer beside the weights.

Flags are Megatron-LM's (tools/checkpoint/convert.py). Any refusal (a model no Hugging Face
class expresses, a directory that is not a checkpoint, another architecture, an existing
--save-dir) is one line and exit status 1, and nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from parm_trainer.process_exit import end


LOADERS = {"hf": "hf", "mixtral_hf": "hf", "loader_mixtral_hf": "hf", "parm": "parm",
           "mcore": "parm", "loader_mcore": "parm"}
SAVERS = {"parm": "parm", "mcore": "parm", "saver_mcore": "parm", "hf": "hf"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model-type", choices=["GPT", "BERT"], default=None,
                        help="Read from the checkpoint (run.json) or config.json; accepted "
                             "for Megatron-LM's command lines.")
    # Megatron-LM's names beside ours: examples/mixtral converts with
    # --loader loader_mixtral_hf --saver mcore --target-*-parallel-size
    parser.add_argument("--loader", choices=[*LOADERS], required=True,
                        help="hf (Megatron-LM: mixtral_hf, loader_mixtral_hf) or parm "
                             "(Megatron-LM: mcore).")
    parser.add_argument("--saver", choices=[*SAVERS], required=True,
                        help="parm (Megatron-LM: mcore, saver_mcore) or hf.")
    for flag in ("--target-tensor-parallel-size", "--target-pipeline-parallel-size",
                 "--target-expert-parallel-size"):
        parser.add_argument(flag, type=int, default=None,
                            help="No effect here (a checkpoint loads under any layout).")
    parser.add_argument("--load-dir", required=True,
                        help="parm: the --save directory of a run; hf: a model directory.")
    parser.add_argument("--save-dir", required=True, help="Written whole; must not exist.")
    parser.add_argument("--tokenizer-model", default=None,
                        help="hf loader: the SentencePiece model file, or a directory with "
                             "tokenizer.json (HuggingFaceTokenizer); default: the model "
                             "directory's own.")
    parser.add_argument("--tokenizer-type", default=None,
                        choices=["SentencePieceTokenizer", "HuggingFaceTokenizer"],
                        help="hf loader: the tokenizer the checkpoint carries (Megatron-LM's "
                             "name); default: SentencePieceTokenizer where there is a "
                             "tokenizer.model, else HuggingFaceTokenizer (tokenizer.json).")
    parser.add_argument("--max-shard-size", default=None,
                        help="hf saver: the largest safetensors shard, as transformers' "
                             "save_pretrained takes it (5GB, 500MB, 2GiB or bytes; default "
                             "5GB); more than one shard comes with model.safetensors.index.json.")
    args = parser.parse_args(argv)
    args.loader, args.saver = LOADERS[args.loader], SAVERS[args.saver]
    targets = [flag for flag in ("tensor", "pipeline", "expert")
               if getattr(args, f"target_{flag}_parallel_size") is not None]
    if targets:
        print(f"--target-{'/'.join(targets)}-parallel-size: no effect here; every tensor is saved "
              f"in its layout-free global shape and loads under any layout")
    warnings.filterwarnings("ignore")
    from parm_trainer.convert.output import parse_size

    try:
        max_shard_size = parse_size(args.max_shard_size or "5GB")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    from parm_trainer.convert.hf import ConvertError, export_to_hf, import_from_hf
    from parm_trainer.convert.hf_tokenizer import TokenizerNotExportable
    from parm_trainer.convert.decoder import NotExportable
    from parm_trainer.training.checkpoint.files import CheckpointError

    try:
        if (args.loader, args.saver) == ("parm", "hf"):
            class_name = export_to_hf(args.load_dir, args.save_dir, max_shard_size)
            print(f"wrote {args.save_dir}: {class_name}, with its tokenizer")
        elif (args.loader, args.saver) == ("hf", "parm"):
            script, flags = import_from_hf(args.load_dir, args.save_dir, args.tokenizer_model,
                                           args.tokenizer_type)
            print(f"wrote {args.save_dir}; train from it with:\n"
                  f"  {script} {' '.join(flags)} --data-path ... [layout flags]")
        else:
            raise ConvertError(f"--loader {args.loader} --saver {args.saver}: nothing to "
                               f"convert (use parm -> hf or hf -> parm)")
    except (ConvertError, NotExportable, TokenizerNotExportable, CheckpointError,
            FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    end(main())
