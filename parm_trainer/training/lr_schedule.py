"""The learning-rate schedule as Megatron-LM's get_optimizer_param_scheduler builds it:
megatron-core's OptimizerParamScheduler counting samples, stepped after each iteration by the
samples that iteration trained on (its global batch, ramped up or not; training/loop.py).

Iteration-based training (--train-iters) counts its lengths in full global batches, so its
learning rate at iteration i is the one an iteration-counting schedule gives; sample-based
training (--train-samples) gives its lengths in samples, and a ramp-up's small early batches
advance the schedule less than full ones.
"""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def schedule_steps(args) -> dict:
    """The warmup, decay and weight-decay lengths in samples, from the flags of the run's kind
    of training; --lr-warmup-fraction takes its share of the decay instead of a warmup flag."""
    if args.train_samples is None:
        batch = args.global_batch_size
        decay, warmup = args.lr_decay_iters * batch, args.lr_warmup_iters * batch
        weight_decay = args.train_iters * batch
    else:
        decay, warmup = args.lr_decay_samples, args.lr_warmup_samples
        weight_decay = args.train_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wd_incr_steps": weight_decay}


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """The run's schedule from its first sample on (a resumed run loads its position and, as
    megatron-core's default use_checkpoint_opt_param_scheduler has it, its lengths from the
    checkpoint). The weight decay stays --weight-decay throughout."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_style="constant",
        **schedule_steps(args),
    )
