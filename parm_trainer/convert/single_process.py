"""The project's model on one process, no GPU: what the converters read and write through.

A checkpoint of any layout loads into the one-rank model through the same strict
dist_checkpointing path as training (parm_trainer.training.checkpoint), so every tensor
arrives whole; a model built here and saved is a checkpoint that any layout loads.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch

from parm_trainer.arguments import parse_args

ONE_RANK = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                expert_model_parallel_size=1, expert_tensor_parallel_size=1,
                sequence_parallel=False, use_distributed_optimizer=False, world_size=1,
                moe_parm_schedule="megatron", distributed_backend="gloo",
                # the saved run's stages: one stage holds everything here
                pipeline_model_parallel_layout=None, decoder_first_pipeline_num_layers=None,
                decoder_last_pipeline_num_layers=None, num_virtual_stages_per_pipeline_rank=None,
                num_layers_per_virtual_pipeline_stage=None,
                virtual_pipeline_model_parallel_size=None, pipeline_stages=None,
                # megatron's local modules and one tensor per expert: GroupedMLP's checkpoint
                # (--moe-grouped-gemm) holds the same tensors under the same keys
                transformer_impl="local", moe_grouped_gemm=False)


def one_rank_args(saved_args: dict, **overrides) -> argparse.Namespace:
    """pretrain's defaults, then the saved run's flags, then one rank's layout."""
    args = parse_args([], world_size=1)
    for key, value in saved_args.items():
        if key not in ("params_dtype", "tokenizer"):  # rebuilt below; an object in training
            setattr(args, key, value)
    for key, value in {**ONE_RANK, **overrides}.items():
        setattr(args, key, value)
    args.params_dtype = torch.float32
    args.bf16 = args.fp16 = False
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_one_rank_model(args: argparse.Namespace, meta: bool = False):
    """Start a one-rank process group and build the GPT-MoE (or, with args.model_family "bert",
    the MoE BERT) args describes, weights drawn as in training from --seed; meta: on the meta
    device, every tensor's name, shape and place in a checkpoint and no data (the streaming
    converters)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from parm_trainer.compat import cpu
    from parm_trainer.models.config import transformer_config
    from parm_trainer.models.bert import build_bert_moe
    from parm_trainer.models.gpt import build_gpt_moe
    from parm_trainer.models.init import init_weights_layout_free
    from parm_trainer.parallel import initialize_distributed

    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    cpu.apply()
    initialize_distributed(args)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    build = build_bert_moe if getattr(args, "model_family", "gpt") == "bert" else build_gpt_moe
    config = transformer_config(args)
    if meta:
        config.perform_initialization = False
        with torch.device("meta"):  # megatron builds on the CPU here (use_cpu_initialization)
            return build(args, config, args.padded_vocab_size).eval()
    model = build(args, config, args.padded_vocab_size)
    init_weights_layout_free(model, args.seed, args.init_method_std, args.num_layers)
    model.eval()
    return model


def close() -> None:
    from parm_trainer.parallel import destroy_distributed

    destroy_distributed()


def latest(load_dir: str) -> str:
    """The iteration directory a checkpoint's tracker names (ConvertError when none)."""
    from parm_trainer.convert.output import ConvertError
    from parm_trainer.training.checkpoint import files

    try:
        return files.latest_dir(load_dir)
    except files.CheckpointError as error:
        raise ConvertError(f"--load-dir {error}") from None


def load_one_rank(load_dir: str, **overrides):
    """(model on one rank with the checkpoint's weights, its tokenizer file)."""
    from parm_trainer.training import checkpoint  # torch, megatron-core: when needed
    from parm_trainer.training.checkpoint import files

    path = latest(load_dir)
    description = files.read_description(path)
    tokenizer = os.path.join(path, files.TOKENIZER)
    args = one_rank_args(description["args"], tokenizer_model=tokenizer, **overrides)
    model = build_one_rank_model(args)
    checkpoint.load_checkpoint(load_dir, [model], None, None, load_optimizer=False,
                               load_rng=False)
    return model, tokenizer
