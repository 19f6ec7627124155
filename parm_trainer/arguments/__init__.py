"""Command-line flags, with Megatron-LM's names, parsed into one typed namespace.

    python pretrain_gpt_moe.py --help

Every flag keeps the spelling Megatron-LM users know (--tensor-model-parallel-size,
--expert-tensor-parallel-size, --moe-router-topk, ...). `parse_args` returns an
argparse.Namespace with derived fields filled in (data-parallel size, number of micro-batches);
`transformer_config(args)` turns it into megatron-core's TransformerConfig.

    flags.py       the flags and the parser
    checks.py      the checks of parsed values (one ArgumentsError line each)
    round_trip.py  the model's flags, and the command line that gives a set of values
    megatron_only.py  Megatron-LM's flags with no effect here, or refused
    recompute.py   activation recomputation's flags and checks
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Optional, Sequence

from parm_trainer.arguments.checks import check
from parm_trainer.arguments.flags import add_bert_args, build_parser, default_tokenizer_type
from parm_trainer.arguments.megatron_only import notes
from parm_trainer.arguments.recompute import settle as settle_recompute
from parm_trainer.arguments.round_trip import command_line, model_argument_names
from parm_trainer.errors import ArgumentsError

__all__ = ["ArgumentsError", "add_bert_args", "build_parser", "command_line", "given_flags",
           "model_argument_names", "parse_args"]


def parse_args(argv: Optional[Sequence[str]] = None, extra_args_provider=None,
               world_size: Optional[int] = None, override=None,
               without_torch: bool = False) -> argparse.Namespace:
    """Parse flags and fill in defaults that depend on other flags and the world size.
    override(args, given) -> lines to log: changes the parsed values before the defaults that
    depend on them (given: the flags on the command line, as attribute names).
    without_torch: the checks an entry point makes before it imports torch (user_errors.
    check_flags_first); what asks torch (the backend, the dtype, CUDA-only libraries) is left
    to the full parse."""
    args = _parser(extra_args_provider, sys.argv[0]).parse_args(argv)
    overridden = override(args, given_flags(argv, extra_args_provider)) if override else []
    args.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if args.ffn_hidden_size is None:  # `is None`: a 0 given is refused, not replaced
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    _training_length_defaults(args)
    if args.watchdog_timeout_minutes is None:
        args.watchdog_timeout_minutes = args.distributed_timeout_minutes
    if args.tokenizer_type is None:
        args.tokenizer_type = default_tokenizer_type(args)
    if not without_torch:
        _torch_settings(args)
    if args.moe_pad_expert_input_to_capacity:  # Megatron-LM's flag: experts padded to capacity
        args.moe_parm_exchange = "padded"
    args.start_notes = overridden + notes(args)  # the lines start-up logs once (initialize.py)
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # as Megatron-LM: no numerics change without MP
        args.start_notes.append("--sequence-parallel is off: the tensor model parallel size is "
                                "1 (as in Megatron-LM)")
    if args.transformer_impl == "local" and args.attention_backend in ("flash", "fused"):
        args.start_notes.append(f"--attention-backend {args.attention_backend}: megatron-core's "
                                f"unfused DotProductAttention runs under --transformer-impl local")
    check(args, without_torch)
    settle_recompute(args)
    return args


def _torch_settings(args) -> None:
    import torch

    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    args.params_dtype = (torch.float16 if args.fp16 else torch.bfloat16 if args.bf16
                         else torch.float32)


@functools.lru_cache(maxsize=8)
def _parser(extra_args_provider, program: str) -> argparse.ArgumentParser:
    """build_parser's parser, built once per entry point and program name (its usage names
    sys.argv[0]) and reused: argparse parses with one parser any number of times, and every
    default is immutable. Building it costs ten times the parse (a benchmark or test
    worker parses the flags of hundreds of layers)."""
    return build_parser(extra_args_provider)


def given_flags(argv, extra_args_provider=None) -> set:
    """The attribute names of the flags on the command line (a parser without defaults)."""
    parser = build_parser(extra_args_provider)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


DEFAULT_TRAIN_ITERS = 100  # a run given neither --train-iters nor --train-samples


def _training_length_defaults(args) -> None:
    """Megatron-LM's defaults of its two kinds of schedule: iteration-based (--train-iters,
    here also when neither is given) decays over --train-iters, sample-based (--train-samples;
    its iterations are derived once the global batch size is known, planning/checks.py) over
    --train-samples. The other kind's flags stay unset, so that checks.py can refuse them."""
    if args.train_samples is None:
        if args.train_iters is None:
            args.train_iters = DEFAULT_TRAIN_ITERS
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
    elif args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples
