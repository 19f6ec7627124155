"""Whether --overlap-moe-expert-parallel-comm runs a job's micro-batches in pairs, and how many
it then holds at once: flag logic the memory estimate and the training loop share
(training/microbatch_overlap.py runs the pairs).
"""

from __future__ import annotations

IN_FLIGHT = 2


def not_applied(args, microbatches: int = None):
    """Why --overlap-moe-expert-parallel-comm, given, does not apply to this run's training
    (None where it does): it needs Parm's MoE layers (megatron's dispatcher waits in place, so
    nothing would overlap), no pipeline stages, at least two micro-batches, and no recompute
    that runs the other micro-batch inside its own: full recompute re-runs the MoE layers'
    exchange, where the turn passes, while the RNG states of its replayed dropout are set;
    megatron-core's layernorm recompute keeps one discarded norm output per layer.
    microbatches: per step (default: args.num_microbatches, which validation sets)."""
    if not args.num_experts or args.moe_parm_schedule == "megatron":
        return "no Parm MoE layers"
    if args.pipeline_model_parallel_size > 1:
        return "pipeline parallelism (megatron's 1F1B schedule runs)"
    if (args.num_microbatches if microbatches is None else microbatches) < 2:
        return "one micro-batch per step"
    if getattr(args, "recompute_granularity", None) == "full":
        return "--recompute-granularity full (its recompute passes the turn mid-layer)"
    if (getattr(args, "recompute_granularity", None) == "selective"
            and "layernorm" in (getattr(args, "recompute_modules", None) or ())):
        return "--recompute-modules layernorm (one discarded norm output per layer)"
    return None


def in_flight(args, microbatches: int) -> int:
    """Micro-batches the overlapped schedule holds at once: 2 where it applies, else 1 (with
    pipeline stages megatron's schedule runs, whose count stages.predict makes)."""
    overlap = getattr(args, "overlap_moe_expert_parallel_comm", False)
    return IN_FLIGHT if overlap and not_applied(args, microbatches) is None else 1
