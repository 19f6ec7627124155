"""The start-up memory estimate per rank (Megatron-LM's --report-theoretical-memory, right for
MoE): what each pipeline rank holds for its own stage, from the whole-model cost model.

    ranks, iteration_s = estimate(args, profile)
    for line in describe(ranks): print(line)

Per pipeline rank (its chunks under the run's layout, args.pipeline_stages):
  weights and gradients  the parameters this rank holds (dense ones / MP, experts / (EP x ESP),
                         the word embedding once where E and L share a stage) in the model's
                         dtype, and their fp32 gradient buffer (megatron's DDP)
  optimizer              Adam's two fp32 moments (and an fp32 copy under bf16 or fp16); with
                         --use-distributed-optimizer the dense ones over DP, the experts' over
                         the expert-DP group
  activations            what autograd saves per micro-batch (top-k expert rows included; less
                         under recomputation: planning/recompute_cost.py), at
                         the peak over megatron's schedule of the micro-batches the rank's chunks
                         hold (P - k on stage k under 1F1B; interleaved:
                         stages.live_micro_batches; without stages, two with
                         --overlap-moe-expert-parallel-comm)
  dispatch buffers       one MoE layer's exchange at a time: the rows it sends and receives
                         (transient, not saved)
The same numbers the stage builder splits by under --memory-gb (stages.predict and
rank_memory.py: stages.price_split). They leave out
the framework itself (CUDA context, allocator caching, on CPU the interpreter and libraries).
"""

from __future__ import annotations

from parm_trainer.moe.cost_profile import DEFAULT_PROFILE
from parm_trainer.planning import recompute_cost
from parm_trainer.planning.model_cost import ModelCost
from parm_trainer.planning.rank_memory import entries
from parm_trainer.planning.stages import predict

MIB = 2 ** 20


def stage_runs(args, pieces: list) -> list:
    """The pieces of each model chunk, in megatron's chunk order, under the run's layout."""
    from parm_trainer.planning.layout import chunks_of

    pp = args.pipeline_model_parallel_size
    runs = []
    for chunk in chunks_of(args.pipeline_stages, pp):  # set by layout.check_pipeline
        run = [pieces[0]] if chunk.embedding else []
        run += [pieces[1 + layer] for layer in chunk.layers]
        runs.append(run + ([pieces[-1]] if chunk.loss else []))
    return runs


def estimate(args, profile=None) -> tuple:
    """([per pipeline rank: {"weights_grads", "optimizer", "activations", "in_flight",
    "dispatch", "total"} in bytes, "compute_s": its chunks' forward + backward per micro-batch,
    without the P2P transfers}], the predicted iteration seconds), priced with profile (the
    default profile if None; memory does not depend on it)."""
    cost = ModelCost(args, profile or DEFAULT_PROFILE)
    runs = recompute_cost.full(args, stage_runs(args, cost.pieces()),
                               recompute_cost.kept_input(cost))
    pp = args.pipeline_model_parallel_size
    microbatches = max(1, args.global_batch_size // (args.micro_batch_size * cost.dp))
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    predicted = predict(runs, cost, pp, len(runs) // pp, microbatches, tied)
    return entries(args, cost, runs, predicted, microbatches), predicted["iteration_s"]


def describe_times(ranks: list, iteration_s: float, source: str) -> str:
    """The log line of predicted times."""
    stages = ", ".join(f"PP rank {r} {e['compute_s'] * 1e3:.2f} ms" for r, e in enumerate(ranks))
    return (f"predicted forward + backward per micro-batch ({source}): {stages}; "
            f"{iteration_s * 1e3:.1f} ms per iteration")


def describe(ranks: list) -> list:
    """Log lines: one per pipeline rank."""
    lines = ["memory estimate per rank (theoretical; the framework's own memory comes on top):"]
    for r, e in enumerate(ranks):
        where = f"  PP rank {r}: " if len(ranks) > 1 else "  "
        lines.append(f"{where}{e['total'] / MIB:.1f} MiB = weights and gradients "
                     f"{e['weights_grads'] / MIB:.1f} + optimizer {e['optimizer'] / MIB:.1f} + "
                     f"activations {e['activations'] / MIB:.1f} ({e['in_flight']} micro-batch"
                     f"{'es' if e['in_flight'] != 1 else ''} in flight) + MoE dispatch buffers "
                     f"{e['dispatch'] / MIB:.1f}")
    return lines
