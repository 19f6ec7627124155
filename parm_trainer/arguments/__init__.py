"""Command-line flags, with Megatron-LM's names, parsed into one typed namespace.

    python pretrain_gpt_moe.py --help

Every flag keeps the spelling Megatron-LM users know (--tensor-model-parallel-size,
--expert-tensor-parallel-size, --moe-router-topk, ...). `parse_args` returns an
argparse.Namespace with derived fields filled in (data-parallel size, number of micro-batches);
`transformer_config(args)` turns it into megatron-core's TransformerConfig.

    flags.py       the flags and the parser
    checks.py      the checks of parsed values (one ArgumentsError line each)
    round_trip.py  the model's flags, and the command line that gives a set of values
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

import torch

from parm_trainer.arguments.checks import check
from parm_trainer.arguments.flags import add_bert_args, build_parser
from parm_trainer.arguments.round_trip import command_line, model_argument_names
from parm_trainer.errors import ArgumentsError

__all__ = ["ArgumentsError", "add_bert_args", "build_parser", "command_line",
           "model_argument_names", "parse_args"]


def parse_args(argv: Optional[Sequence[str]] = None, extra_args_provider=None,
               world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse flags and fill in defaults that depend on other flags and the world size."""
    args = build_parser(extra_args_provider).parse_args(argv)
    args.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if args.ffn_hidden_size is None:  # `is None`: a 0 given is refused, not replaced
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.watchdog_timeout_minutes is None:
        args.watchdog_timeout_minutes = args.distributed_timeout_minutes
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    args.params_dtype = (torch.float16 if args.fp16 else torch.bfloat16 if args.bf16
                         else torch.float32)
    if args.moe_pad_expert_input_to_capacity:  # Megatron-LM's flag: experts padded to capacity
        args.moe_parm_exchange = "padded"
    check(args)
    return args
