"""Megatron-LM's flags for today's MoE blocks: shared experts, the router's score function,
expert bias, group-limited top-k and scaling, its dtype, forced balancing, per-layer logging.

Each keeps Megatron-LM's name, type and default (megatron/training/arguments.py) and maps to
the TransformerConfig field of the same name (models/config.py). `problem(args)` is the first
impossible combination megatron-core's TransformerConfig (or its router) would refuse, as one
line, or None; arguments/checks.py raises it before any process group starts.
"""

from __future__ import annotations

from typing import Optional

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def add_flags(g) -> None:
    """Add the flags to the "mixture of experts" argument group g (they define the model)."""
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES,
                   default="aux_loss",
                   help="Load-balancing loss: aux_loss (per micro-batch), seq_aux_loss (per "
                        "sequence, DeepSeek-V3), global_aux_loss (over the global batch), none.")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="Shared expert total FFN hidden size (num shared experts x each one's "
                        "size); every token goes through it beside its routed experts. "
                        "Default: no shared expert. Needs --disable-bias-linear.")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="Scale the shared expert's output by sigmoid(x . w), a learned gate "
                        "(Qwen2-MoE).")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="Run the shared expert while the routed experts' tokens are on the wire "
                        "(Parm's schedules: between issuing the exchange and waiting for it; "
                        "--moe-parm-schedule megatron: megatron-core's alltoall dispatcher's "
                        "overlap). Parm's schedules overlap by default where auto measures it "
                        "faster; this flag forces it.")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"],
                   default="softmax", help="Router score function (DeepSeek-V3: sigmoid).")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Auxiliary-loss-free balancing: a per-expert bias added to the scores for "
                        "the top-k choice only, moved by --moe-router-bias-update-rate towards "
                        "the mean load after every global batch (needs sigmoid scores).")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="Step of the expert bias update (sign of mean load - expert load).")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="Group-limited routing: experts in this many equal groups (e.g. the EP "
                        "size for device-limited, the nodes of an EP group for node-limited).")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="Groups each token may choose its experts from (with "
                        "--moe-router-num-groups).")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="Scale the top-k routing probabilities (DeepSeek-V3: 2.5).")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None,
                   help="Dtype of the router's logits and scores (default: the input's).")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="Benchmarking: route on random logits, so every expert gets about the "
                        "same load (the router's gradient passes straight through).")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="Log each MoE layer's load-balancing and z losses (log, tensorboard, "
                        "wandb) beside their mean over layers.")


# the flags' TransformerConfig fields, each of the flag's own name
CONFIG_FIELDS = ("moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                 "moe_shared_expert_overlap", "moe_router_score_function",
                 "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
                 "moe_router_num_groups", "moe_router_group_topk",
                 "moe_router_topk_scaling_factor", "moe_router_dtype",
                 "moe_router_force_load_balancing", "moe_per_layer_logging")


def router_dtype(name: Optional[str], default):
    """--moe-router-dtype's torch dtype (fp32, fp64), else `default` (the tokens' dtype).
    torch is imported here, not above: the flags are checked before torch is imported."""
    import torch

    return {"fp32": torch.float32, "fp64": torch.float64}.get(name, default)


def config_fields(args) -> dict:
    """The TransformerConfig fields of these flags."""
    return {name: getattr(args, name) for name in CONFIG_FIELDS}


def shared_experts_recomputed(args) -> bool:
    """Whether --recompute-modules shared_experts is asked (megatron-core refuses it with the
    overlapped shared expert, so a start-up choice must not overlap it)."""
    return (getattr(args, "recompute_granularity", None) == "selective"
            and "shared_experts" in (getattr(args, "recompute_modules", None) or ()))


def problem(args) -> Optional[str]:
    """The first impossible combination of these flags, as one line; None if none (each
    value's own range is flag_ranges.py's)."""
    experts, topk = args.num_experts, args.moe_router_topk
    shared = args.moe_shared_expert_intermediate_size
    if shared is not None and not args.disable_bias_linear:
        return ("--moe-shared-expert-intermediate-size: megatron-core's shared expert has no "
                "biases; add --disable-bias-linear")
    if shared is not None and not experts:
        return "--moe-shared-expert-intermediate-size needs --num-experts"
    if (shared is not None and args.moe_shared_expert_overlap
            and getattr(args, "moe_parm_schedule", "") == "megatron"
            and args.moe_token_dispatcher_type != "alltoall"):
        return ("--moe-shared-expert-overlap with --moe-parm-schedule megatron works with "
                "--moe-token-dispatcher-type alltoall only (megatron-core)")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        return ("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                "(megatron-core's aux-loss-free routing)")
    return _groups_problem(args.moe_router_num_groups, args.moe_router_group_topk, experts, topk)


def _groups_problem(groups, group_topk, experts, topk) -> Optional[str]:
    if group_topk is None:  # (their ranges: flag_ranges.py)
        return None
    if groups is None:
        return "--moe-router-group-topk needs --moe-router-num-groups"
    if experts and experts % groups:
        return (f"--num-experts {experts} is not divisible by --moe-router-num-groups "
                f"{groups}")
    if group_topk > groups:
        return (f"--moe-router-group-topk {group_topk} must not exceed "
                f"--moe-router-num-groups {groups}")
    # megatron's group_limited_topk picks k experts among the chosen groups' experts only
    if experts and topk > group_topk * (experts // groups):
        return (f"--moe-router-topk {topk} is more than the {group_topk * (experts // groups)} "
                f"experts of --moe-router-group-topk {group_topk} groups of "
                f"{experts // groups}")
    return None

