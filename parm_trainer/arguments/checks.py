"""The checks of parsed flags that need no process group: ranges, flags that exclude each other,
and the libraries a flag asks for. Each problem is one ArgumentsError line."""

from __future__ import annotations

import math
import re

from parm_trainer import flag_ranges, mla_flags, moe_flags, mtp_flags
from parm_trainer.arguments.megatron_only import problem as refused_flag
from parm_trainer.arguments.recompute import problem as recompute_problem
from parm_trainer.errors import ArgumentsError


def check(args, without_torch: bool = False) -> None:
    """The first impossible value or combination, raised as one ArgumentsError line;
    without_torch: all but the checks that ask torch about CUDA (see parse_args)."""
    if (out_of_range := flag_ranges.problem(args)) is not None:  # every numeric flag's range
        raise ArgumentsError(out_of_range)
    if (schedule_problem := _schedule_problem(args)) is not None:
        raise ArgumentsError(schedule_problem)
    if args.use_distributed_optimizer and args.optimizer != "adam":
        raise ArgumentsError("--use-distributed-optimizer supports --optimizer adam only")
    if not 0 <= args.min_lr <= args.lr:
        raise ArgumentsError(f"--min-lr {args.min_lr} must be between 0 and --lr {args.lr}")
    if (refused := refused_flag(args)) is not None:
        raise ArgumentsError(refused)
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentsError("--overlap-param-gather needs --use-distributed-optimizer (it "
                             "overlaps the distributed optimizer's parameter all-gather)")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ArgumentsError("--overlap-param-gather needs --overlap-grad-reduce "
                             "(as in Megatron-LM)")
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise ArgumentsError("--no-position-embedding is deprecated in Megatron-LM and valid "
                             "only with --position-embedding-type rope; use "
                             "--position-embedding-type")
    if (precision := _precision_problem(args)) is not None:
        raise ArgumentsError(precision)
    if args.qk_layernorm_across_heads and not args.qk_layernorm:
        raise ArgumentsError("--qk-layernorm-across-heads needs --qk-layernorm (it says over "
                             "what the query and key norms normalise)")
    if args.qk_layernorm_across_heads and args.normalization != "RMSNorm":
        raise ArgumentsError("--qk-layernorm-across-heads needs --normalization RMSNorm (its "
                             "norm is an RMSNorm over all heads)")
    if args.qk_layernorm_across_heads and args.multi_latent_attention:
        raise ArgumentsError("--qk-layernorm-across-heads with --multi-latent-attention: "
                             "multi-latent attention normalises its query and key/value "
                             "latents, not the heads")
    if not without_torch:
        _check_backend(args)
    if (moe_problem := moe_flags.problem(args)) is not None:
        raise ArgumentsError(moe_problem)
    if (recompute := recompute_problem(args)) is not None:
        raise ArgumentsError(recompute)
    if (mla_problem := mla_flags.problem(args)) is not None:
        raise ArgumentsError(mla_problem)
    if (mtp_problem := mtp_flags.problem(args)) is not None:
        raise ArgumentsError(mtp_problem)
    if not _split_is_valid(args.split):
        raise ArgumentsError(f"--split {args.split!r} must be up to three non-negative "
                             f"train,valid,test proportions with a positive sum, e.g. 969,30,1")


def _schedule_problem(args) -> str | None:
    """What Megatron-LM's validate_args asserts of the two kinds of schedule, as one line:
    iteration-based (--train-iters) and sample-based (--train-samples) training take only
    their own kind's decay, warmup and ramp-up flags; megatron-core's OptimizerParamScheduler
    asserts a warmup shorter than the decay and an initial learning rate up to --lr."""
    if args.train_iters is not None and args.train_samples is not None:
        return ("--train-iters and --train-samples exclude each other: train for a number of "
                "iterations or of samples (as in Megatron-LM)")
    if args.train_samples is None:
        # a ramp-up under --train-iters: Megatron-LM's validate_args refuses it, yet its own
        # GPT-3 recipe (examples/gpt3, core_v0.16.1) asks for it; here it trains as asked,
        # --train-iters iterations of the ramped sizes, the LR schedule counting samples
        strays = {"--lr-decay-samples": args.lr_decay_samples is not None,
                  "--lr-warmup-samples": bool(args.lr_warmup_samples)}
        needs = "sample-based training (--train-samples); this run counts iterations"
        unit, warmup, decay = "iters", args.lr_warmup_iters, args.lr_decay_iters
    else:
        strays = {"--lr-decay-iters": args.lr_decay_iters is not None,
                  "--lr-warmup-iters": bool(args.lr_warmup_iters)}
        needs = "iteration-based training (--train-iters); this run counts samples"
        unit, warmup, decay = "samples", args.lr_warmup_samples, args.lr_decay_samples
    for flag, given in strays.items():
        if given:
            return f"{flag} needs {needs} (--train-{unit})"
    if args.lr_warmup_fraction is not None and warmup:
        return (f"--lr-warmup-fraction and --lr-warmup-{unit} exclude each other: give one "
                f"warmup")
    if warmup and warmup >= decay:
        return (f"--lr-warmup-{unit} {warmup} must be smaller than --lr-decay-{unit} {decay} "
                f"(default --train-{unit})")
    if args.lr_warmup_init > args.lr:
        return f"--lr-warmup-init {args.lr_warmup_init} must not exceed --lr {args.lr}"


def _precision_problem(args) -> str | None:
    """--fp16 and its loss scaling as Megatron-LM's validate_args and megatron-core's
    DynamicGradScaler take them (their bare asserts, as one line each)."""
    if args.fp16 and args.bf16:
        return "--fp16 and --bf16 exclude each other: choose one"
    if not args.fp16 or args.loss_scale:  # no dynamic scaler is built
        return None
    if args.min_loss_scale > args.initial_loss_scale:
        return (f"--min-loss-scale {args.min_loss_scale:g} must not exceed "
                f"--initial-loss-scale {args.initial_loss_scale:g}")
    if args.loss_scale_window != int(args.loss_scale_window):
        # megatron-core compares an integer count with it: a fraction never raises the scale
        return (f"--loss-scale-window {args.loss_scale_window:g} must be a whole number of "
                f"iterations")
    return None


def _check_backend(args) -> None:
    """--transformer-impl and --moe-grouped-gemm ask for libraries a machine may not have."""
    import torch

    from parm_trainer.models.backend import installed as _installed

    te = args.transformer_impl == "transformer_engine"
    if te and not _installed("transformer_engine"):
        raise ArgumentsError("--transformer-impl transformer_engine: Transformer Engine is not "
                             "installed (pip install transformer_engine[pytorch] on a GPU "
                             "machine); --transformer-impl local runs everywhere")
    if te and not torch.cuda.is_available():
        raise ArgumentsError("--transformer-impl transformer_engine needs CUDA GPUs; "
                             "--transformer-impl local runs on CPU")
    if args.moe_grouped_gemm and args.num_experts and not te:
        for missing, flag in ((not args.bf16, "--bf16"),
                              (not args.disable_bias_linear, "--disable-bias-linear")):
            if missing:
                raise ArgumentsError(f"--moe-grouped-gemm with --transformer-impl local runs "
                                     f"megatron-core's GroupedMLP, which needs {flag}")
        if torch.cuda.is_available() and not _installed("grouped_gemm"):
            raise ArgumentsError("--moe-grouped-gemm needs Transformer Engine (--transformer-impl"
                                 " transformer_engine) or the grouped_gemm package "
                                 "(pip install git+https://github.com/fanshiqing/grouped_gemm)")


def _split_is_valid(split: str) -> bool:
    """Whether --split is 1 to 3 non-negative numbers with a positive sum. megatron-core keeps
    only its digits and dots, so it would read '100,-1,1' as 100,1,1 and '1,x' as 1,0,0."""
    try:
        values = [float(part) for part in re.split(r"[,/\s]+", split.strip())]
    except ValueError:
        return False
    return 1 <= len(values) <= 3 and all(0 <= v < math.inf for v in values) and sum(values) > 0
