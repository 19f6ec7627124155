"""--moe-parm-schedule auto: pick S1 or S2 once at start-up with the cost model.

The layer shape comes from the flags (tokens per MP group = --seq-length x --micro-batch-size)
and the cluster from --moe-parm-cost-profile (a JSON profile; see cost_model.Profile) or, without
one, cost_model.DEFAULT_PROFILE, whose numbers are assumed A100 figures, not measurements; the
log says which was used and the predicted time of each candidate.
"""

from __future__ import annotations

import os

from parm_trainer.moe.cost_model import (DEFAULT_PROFILE, LayerShape, Profile, ProfileError,
                                         choose_schedule)


def layer_shape(args) -> LayerShape:
    return LayerShape(
        tokens=args.seq_length * args.micro_batch_size, hidden=args.hidden_size,
        ffn=args.moe_ffn_hidden_size, experts=args.num_experts, topk=args.moe_router_topk,
        capacity_factor=args.moe_expert_capacity_factor, bytes_per_element=2 if args.bf16 else 4,
        mp=args.tensor_model_parallel_size, ep=args.expert_model_parallel_size,
        esp=args.expert_tensor_parallel_size, sequence_parallel=args.sequence_parallel,
        chunks=args.moe_parm_chunks,
        dp=args.world_size // (args.tensor_model_parallel_size
                               * args.pipeline_model_parallel_size))


def load_profile(args) -> Profile:
    """--moe-parm-cost-profile, checked against this job (ProfileError), or the default."""
    path = args.moe_parm_cost_profile
    if not path:
        return DEFAULT_PROFILE
    if not os.path.isfile(path):
        raise ProfileError(f"--moe-parm-cost-profile {path}: no such file")
    profile = Profile.from_json(path)
    if profile.world_size is not None and profile.world_size != args.world_size:
        raise ProfileError(f"--moe-parm-cost-profile {path} was measured on {profile.world_size}"
                           f" ranks, this job has {args.world_size}: calibrate on this layout "
                           "(tools/calibrate_comm.py)")
    return profile


def resolve_auto_schedule(args, log=print) -> None:
    """Replace args.moe_parm_schedule "auto" by the cheaper of s1 and s2, and say why.
    A given profile is checked whatever the schedule, so a bad one never goes unnoticed."""
    profile = load_profile(args)
    if args.moe_parm_schedule != "auto" or not args.num_experts:
        return
    path = args.moe_parm_cost_profile
    source = path or f"the built-in default profile ({profile.description})"
    chosen, predicted = choose_schedule(layer_shape(args), profile)
    times = ", ".join(f"{name} {seconds * 1e3:.3f} ms" for name, seconds in predicted.items())
    log(f"--moe-parm-schedule auto: predicted forward+backward per MoE layer {times} "
        f"with {source}; using {chosen}")
    args.moe_parm_schedule = chosen
