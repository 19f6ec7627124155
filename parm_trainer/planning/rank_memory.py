"""Each pipeline rank's memory as the start-up estimate counts it (memory_estimate.py), from
stages.predict's result for the model chunks: the activations at their peak over the schedule,
plus a pair of micro-batches where --overlap-moe-expert-parallel-comm runs them in pairs, the
parts a recomputed unit holds again during its backward (recompute_cost.transient), and one
MoE layer's dispatch buffers. The stage builder checks its split against the same totals under
--memory-gb (stages.price_split), so a layout it picks passes the start-up check.
"""

from __future__ import annotations

from parm_trainer.planning import recompute_cost
from parm_trainer.planning.paired_microbatches import in_flight


def entries(args, cost, runs: list, predicted: dict, microbatches: int) -> list:
    """Per pipeline rank: {"weights_grads", "optimizer", "activations", "in_flight",
    "dispatch", "total"} in bytes and "compute_s"; runs: the chunks' pieces as priced (full
    recompute applied), predicted: stages.predict's result for them (its ranks are updated)."""
    pp = args.pipeline_model_parallel_size
    ranks = predicted["ranks"]
    paired = in_flight(args, microbatches)  # 1 with pipeline stages
    for r, rank in enumerate(ranks):  # --overlap-moe-expert-parallel-comm holds a pair at once
        extra = (paired - 1) * rank["activation_bytes"] / rank["in_flight"]
        # recomputation: a recomputed part's activations alive again during its backward
        extra += max(recompute_cost.transient(runs[c]) for c in range(r, len(runs), pp))
        rank["in_flight"] *= paired
        rank["activation_bytes"] += extra
        rank["memory_bytes"] += extra
    rows = cost.n * (args.moe_router_topk or 0) * (args.expert_tensor_parallel_size or 1) / cost.tp
    out = []
    for r, rank in enumerate(ranks):
        moe = any(p.kind == "m" for c, run in enumerate(runs) if c % pp == r for p in run)
        dispatch = 2 * rows * args.hidden_size * cost.e if moe else 0.0
        out.append({"weights_grads": rank["weights_grads_bytes"],
                    "optimizer": rank["optimizer_bytes"],
                    "activations": rank["activation_bytes"], "in_flight": rank["in_flight"],
                    "dispatch": dispatch, "compute_s": rank["compute_s"],
                    "total": rank["memory_bytes"] + dispatch})
    return out
