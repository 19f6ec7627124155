"""Every numeric flag's range, checked before the process groups start (arguments/checks.py).

One row per flag (its argparse dest): the lowest and highest value it takes and whether each
bound is itself allowed; None for no bound. A value outside, NaN, or an infinite float is
refused with one line naming the flag and its range (each value of a flag that takes
several). Ranges are Megatron-LM's and torch's own where they have one (Adam's betas in
[0, 1), eps >= 0; dropout a probability), otherwise what the value means (a size is at
least 1; an interval of 0 means never where the flag says so).
"""

from __future__ import annotations

import math

AT_LEAST_1 = (1, None, True, True)
AT_LEAST_0 = (0, None, True, True)
POSITIVE = (0, None, False, True)
PROBABILITY = (0, 1, True, True)
BELOW_1 = (0, 1, True, False)  # [0, 1)

RANGES = {
    # model
    "num_layers": AT_LEAST_1, "hidden_size": AT_LEAST_1, "ffn_hidden_size": AT_LEAST_1,
    "num_attention_heads": AT_LEAST_1, "num_query_groups": AT_LEAST_1,
    "kv_channels": AT_LEAST_1, "seq_length": AT_LEAST_1, "max_position_embeddings": AT_LEAST_1,
    "rotary_base": POSITIVE, "norm_epsilon": POSITIVE, "hidden_dropout": PROBABILITY,
    "attention_dropout": PROBABILITY, "make_vocab_size_divisible_by": AT_LEAST_1,
    "init_method_std": POSITIVE, "recompute_num_layers": AT_LEAST_1,
    # multi-latent attention (YaRN's mscales: 0 turns one off)
    "q_lora_rank": AT_LEAST_1, "kv_lora_rank": AT_LEAST_1, "qk_head_dim": AT_LEAST_1,
    "qk_pos_emb_head_dim": AT_LEAST_1, "v_head_dim": AT_LEAST_1,
    "rotary_scaling_factor": POSITIVE, "mscale": AT_LEAST_0, "mscale_all_dim": AT_LEAST_0,
    # multi-token prediction (Megatron-LM reads 0 layers as none: say so by leaving it out)
    "mtp_num_layers": AT_LEAST_1, "mtp_loss_scaling_factor": AT_LEAST_0,
    # MoE
    "num_experts": AT_LEAST_1, "moe_ffn_hidden_size": AT_LEAST_1, "moe_router_topk": AT_LEAST_1,
    "moe_expert_capacity_factor": POSITIVE, "moe_aux_loss_coeff": AT_LEAST_0,
    "moe_z_loss_coeff": AT_LEAST_0, "moe_parm_chunks": AT_LEAST_0,
    "moe_shared_expert_intermediate_size": AT_LEAST_1, "moe_router_bias_update_rate": AT_LEAST_0,
    "moe_router_num_groups": AT_LEAST_1, "moe_router_group_topk": AT_LEAST_1,
    "moe_router_topk_scaling_factor": POSITIVE,
    # parallelism and the machine
    "tensor_model_parallel_size": AT_LEAST_1, "pipeline_model_parallel_size": AT_LEAST_1,
    "expert_model_parallel_size": AT_LEAST_1, "expert_tensor_parallel_size": AT_LEAST_1,
    "decoder_first_pipeline_num_layers": AT_LEAST_1, "decoder_last_pipeline_num_layers": AT_LEAST_1,
    "num_virtual_stages_per_pipeline_rank": AT_LEAST_1,
    "num_layers_per_virtual_pipeline_stage": AT_LEAST_1, "memory_gb": POSITIVE,
    "ddp_bucket_size": AT_LEAST_1, "ranks_per_node": AT_LEAST_1,
    "distributed_timeout_minutes": POSITIVE, "watchdog_timeout_minutes": AT_LEAST_0,
    # training
    "micro_batch_size": AT_LEAST_1, "global_batch_size": AT_LEAST_1, "train_iters": AT_LEAST_1,
    "lr": AT_LEAST_0, "min_lr": AT_LEAST_0, "lr_warmup_iters": AT_LEAST_0,
    "lr_decay_iters": AT_LEAST_1, "train_samples": AT_LEAST_1, "lr_decay_samples": AT_LEAST_1,
    "lr_warmup_samples": AT_LEAST_0, "lr_warmup_init": AT_LEAST_0,
    "lr_warmup_fraction": BELOW_1,  # a warmup as long as the decay: megatron-core asserts
    # start, increment and samples: each at least 1 (megatron-core divides by the samples)
    "rampup_batch_size": AT_LEAST_1,
    "weight_decay": AT_LEAST_0, "clip_grad": AT_LEAST_0,
    "adam_beta1": BELOW_1, "adam_beta2": BELOW_1, "adam_eps": AT_LEAST_0,
    "seed": (0, 2**32 - 1, True, True),  # numpy's seed range (the data samplers')
    "exit_interval": AT_LEAST_0, "exit_duration_in_mins": POSITIVE,
    "manual_gc_interval": AT_LEAST_0,
    # megatron-core's grad scalers assert these (grad_scaler.py); --loss-scale 0 is Megatron-LM's
    # "no static scale" (its `if config.loss_scale:`), so dynamic scaling under --fp16
    "loss_scale": AT_LEAST_0, "initial_loss_scale": POSITIVE, "min_loss_scale": POSITIVE,
    "loss_scale_window": POSITIVE, "hysteresis": AT_LEAST_1,
    # data, evaluation, logging
    "num_workers": AT_LEAST_0, "vocab_size": AT_LEAST_1, "eval_interval": AT_LEAST_1,
    "eval_iters": AT_LEAST_0,
    "save_interval": AT_LEAST_0, "log_interval": AT_LEAST_1,
    "mask_prob": (0, 1, False, False), "short_seq_prob": PROBABILITY,
}


def describe(bounds) -> str:
    """What the flag must be, as the line says it: "be at least 1", "be in [0, 1)", ..."""
    low, high, low_in, high_in = bounds
    if high is None:
        if low == 0:
            return "not be negative" if low_in else "be positive"
        return f"be at least {low}" if low_in else f"be above {low}"
    left, right = "[" if low_in else "(", "]" if high_in else ")"
    return f"be in {left}{low}, {high}{right}"


def inside(value, bounds) -> bool:
    low, high, low_in, high_in = bounds
    if isinstance(value, float) and not math.isfinite(value):
        return False
    above = value >= low if low_in else value > low
    below = high is None or (value <= high if high_in else value < high)
    return above and below


def problem(args) -> str | None:
    """The first flag outside its range, as the one line to print, or None."""
    for dest, bounds in RANGES.items():
        value = getattr(args, dest, None)
        if value is None or isinstance(value, bool):
            continue
        for item in value if isinstance(value, list) else [value]:  # nargs flags: each value
            if not inside(item, bounds):
                return f"--{dest.replace('_', '-')} must {describe(bounds)}, got {item}"
    return None
