"""bench_moe_layer with today's MoE blocks (parm_trainer/moe_flags.py): what the single-process
reference (moe/reference.py) does not define, and how such rows are checked instead.

The reference is softmax top-k routing, the switch aux loss and the routed experts. A row with
sigmoid scores, the expert bias, group-limited top-k, a scaling factor, a shared expert, another
load-balancing loss, a z-loss or forced balancing is checked against megatron-core's own
MoELayer row of the same launch (a megatron, megatron-alltoall or megatron-allgather row that
ran): full output and input gradient, max abs difference (tests/test_moe_features.py checks
every gradient and loss of these features against megatron's layer). Every row gets the same
shared-expert weights (the first row's). The unique payload reads the routing from megatron's
own routing function (forced balancing routes on random logits: no payload is computed).
"""

from __future__ import annotations

import torch

from parm_trainer.bench.layout import max_over_ranks
from parm_trainer.bench.peers import MEGATRON
from parm_trainer.moe_flags import router_dtype


def beyond_reference(args) -> list:
    """The flags set that the single-process reference does not define."""
    checks = (
        ("--moe-router-score-function sigmoid", args.moe_router_score_function != "softmax"),
        ("--moe-router-enable-expert-bias", args.moe_router_enable_expert_bias),
        ("--moe-router-group-topk", bool(args.moe_router_group_topk)),
        ("--moe-router-topk-scaling-factor", args.moe_router_topk_scaling_factor is not None),
        ("--moe-shared-expert-intermediate-size",
         args.moe_shared_expert_intermediate_size is not None),
        (f"--moe-router-load-balancing-type {args.moe_router_load_balancing_type}",
         args.moe_router_load_balancing_type not in ("aux_loss", "none")),
        ("--moe-z-loss-coeff", bool(args.moe_z_loss_coeff)),
        ("--moe-router-force-load-balancing", args.moe_router_force_load_balancing),
    )
    return [flag for flag, on in checks if on]


def routing_map(args, tokens, gate, gate_calls: int):
    """(T, E) bool: the experts megatron's router picks for tokens (T, M) (its routing function
    and capacity drops, per gate call); None under forced balancing."""
    from megatron.core.transformer.moe.moe_utils import (apply_router_token_dropping,
                                                         topk_routing_with_score_function)

    if args.moe_router_force_load_balancing:
        return None
    dtype = router_dtype(args.moe_router_dtype, tokens.dtype)
    maps = []
    for call in tokens.chunk(gate_calls):
        probs, chosen = topk_routing_with_score_function(
            call.to(dtype) @ gate.to(dtype).t(), args.moe_router_topk,
            use_pre_softmax=args.moe_router_pre_softmax,
            num_groups=args.moe_router_num_groups, group_topk=args.moe_router_group_topk,
            scaling_factor=args.moe_router_topk_scaling_factor,
            score_function=args.moe_router_score_function)
        if args.moe_expert_capacity_factor is not None:
            _, chosen = apply_router_token_dropping(probs, chosen, args.moe_router_topk,
                                                    args.moe_expert_capacity_factor,
                                                    args.moe_token_drop_policy)
        maps.append(chosen)
    return torch.cat(maps).cpu()


class SharedWeights:
    """The first row's shared-expert weights, loaded into every later row (this rank's TP
    shard: every row of a configuration runs on the same layout)."""

    def __init__(self):
        self.state = None

    def load(self, layer) -> None:
        module = getattr(layer, "shared_experts", None)
        if module is None:
            return
        if self.state is None:
            self.state = {k: v.detach().clone() if torch.is_tensor(v) else v
                          for k, v in module.state_dict().items()}  # (_extra_state: None)
        else:
            module.load_state_dict(self.state)


def check_against_megatron(timed: dict) -> None:
    """Rows checked against the megatron row (results holding "_full": the full output and
    input gradient): their max abs differences, max over ranks, and the row they were checked
    against; "_full" removed from every row. Every rank calls it alike."""
    full = {name: result.pop("_full") for name, (result, _) in timed.items()
            if "_full" in result}
    against = next((name for name in timed if name in MEGATRON and name in full), None)
    for name, (result, _) in timed.items():
        if name not in full or name == against:
            continue
        result["checked_against"] = against
        if against is None:
            continue
        for key, got, want in zip(("output", "input_grad"), full[name], full[against]):
            result["max_abs_diff"][key] = max_over_ranks((got - want).abs().max().item())
            result["reference_max_abs"][key] = want.abs().max().item()
