"""What activation recomputation changes in the cost model's pieces (model_cost.py): the bytes a
recomputed part keeps instead of its activations, and, for full recompute, the forward run again
in the backward and the one recomputed unit alive at a time.

    selective  (--recompute-granularity selective, --recompute-modules; model_cost.activations)
      core_attn       the softmax output (and attention dropout's mask and dropped
                      probabilities) and the causal mask go; q, k, v were kept anyway
      mlp             a dense MLP keeps its input (the norm's output) only
      moe             Parm's layer: the local experts keep the rows the exchange delivered, one
                      per (token, EP rank) pair, M + L wide, times ESP (docs/exchange.md; the
                      padded exchange: the dispatched block, about one row per (token, expert)
                      pair); the shared expert keeps nothing of its own. megatron's layer
                      (--moe-parm-schedule megatron) keeps its input only
      shared_experts  the shared expert keeps nothing of its own (its input is the router's)
      layernorm, moe_act  megatron-core's output-discarding checkpoint frees a tensor that
                      autograd still holds a (then empty) reference to: left out here, as the
                      memory probe sees it (training/memory_probe.py)
    full       (--recompute-granularity full; memory_estimate.estimate) each recomputed unit
               keeps its input (one tensor between layers); its layers' forward runs again in
               the backward

While a recomputed part's backward runs, what it dropped is alive again, and the pieces after
it in the chunk have already let go of theirs: transient() is what that adds to the chunk's
saved bytes at its worst, for the one micro-batch in its backward. Time (selective_s): each
recomputed part's forward runs again in its layer's backward, as the code re-runs it: core
attention (scores, softmax, values), the norms, a dense MLP with its MP collectives, Parm's
local experts on the rows received (no exchange) and its shared expert, megatron's whole MoE
layer (exchange included), the grouped experts' activation.
"""

from __future__ import annotations

import math
from dataclasses import replace


def selective(args) -> tuple:
    """The modules selective recompute takes (() without it)."""
    if getattr(args, "recompute_granularity", None) != "selective":
        return ()
    return tuple(getattr(args, "recompute_modules", None) or ("core_attn",))


def core_attention_saved(args, modules: tuple, probs: float, seq: int) -> float:
    """Bytes core_attn recompute frees per layer (probs: one b x h/T x s x s tensor)."""
    if "core_attn" not in modules:
        return 0.0
    dropout = getattr(args, "attention_dropout", 0.0) > 0
    return probs * (3 if dropout else 1) + seq * seq


def dense_mlp(modules: tuple, mlp: float, kept_input: float) -> float:
    return kept_input if "mlp" in modules else mlp


def moe_mlp(cost, modules: tuple, router: float, experts: float, shared: float,
            kept_input: float) -> float:
    """A MoE MLP's saved bytes from its parts (router and routing, experts, shared expert)."""
    a = cost.args
    if "moe" in modules and a.moe_parm_schedule == "megatron":
        return kept_input
    if "moe" in modules and (a.moe_parm_schedule == "baseline"
                             or getattr(a, "moe_parm_exchange", "exact") == "padded"):
        # the dispatched (E, c, M) block: about one row per (token, expert) pair
        experts = (cost.n * a.moe_router_topk * a.expert_tensor_parallel_size / cost.tp
                   * a.hidden_size * cost.e)
    elif "moe" in modules:
        experts = received_rows(cost) * (a.hidden_size + a.num_experts
                                         // a.expert_model_parallel_size) * cost.e
    if "moe" in modules or "shared_experts" in modules:
        shared = 0.0
    return router + experts + shared


def received_rows(cost) -> float:
    """The rows Parm's exact exchange delivers to one rank per micro-batch (after the ESP
    gather), on average under uniform top-k routing: each of the n / MP tokens of every EP
    rank once if one of its k experts is among this rank's L."""
    a = cost.args
    experts, ep, k = a.num_experts, a.expert_model_parallel_size, a.moe_router_topk
    local = experts // ep
    picks = 1 - math.comb(experts - local, k) / math.comb(experts, k)
    return a.expert_tensor_parallel_size * ep * cost.n / cost.tp * picks


def kept_input(cost) -> float:
    """Bytes of one tensor between layers (what a fully recomputed unit keeps)."""
    return cost.n * cost.args.hidden_size * cost.e / (cost.tp if cost.sp else 1)


def selective_s(cost, moe: bool) -> float:
    """Seconds selective recompute adds to one decoder layer's backward (cost: a ModelCost;
    moe: an MoE layer, priced after cost.moe_mlp chose its schedule)."""
    modules, a = selective(cost.args), cost.args
    seconds = 0.0
    if "core_attn" in modules:  # the two GEMMs of scores and values and the softmax's traffic
        from parm_trainer.mla_flags import attention_sizes

        b, s, sizes = a.micro_batch_size, a.seq_length, attention_sizes(a)
        seconds += cost.gemm(2 * b * s * s * (sizes["score"] + sizes["value"]) / cost.tp,
                             calls=2)
        seconds += cost.traffic(3 * b * a.num_attention_heads / cost.tp * s * s * cost.e)
    if "layernorm" in modules:  # the input and pre-MLP norms
        seconds += 2 * cost.traffic(2 * kept_input(cost))
    if not moe:
        return seconds + (cost.mlp()[0] if "mlp" in modules else 0.0)
    if "moe" in modules and a.moe_parm_schedule == "megatron":
        seconds += cost.moe_mlp()[0]  # megatron's checkpoint of its whole MoELayer
    elif "moe" in modules:
        seconds += _local_experts_s(cost)
    if "shared_experts" in modules or ("moe" in modules and a.moe_parm_schedule != "megatron"):
        seconds += _shared_expert_s(cost)
    if "moe_act" in modules and "moe" not in modules:  # the activation over the expert rows
        rows = cost.n * a.moe_router_topk / cost.tp
        seconds += cost.traffic(rows * a.moe_ffn_hidden_size * cost.e
                                * (3 if getattr(a, "swiglu", False) else 2))
    return seconds


def _chosen_shape(cost):
    """(plan, LayerShape) of the MoE schedule and depth cost.moe_mlp priced."""
    from parm_trainer.moe.cost_model import shape_plan
    from parm_trainer.moe.cost_shape import layer_shape

    name, chunks = cost.moe_choice
    shape = replace(layer_shape(cost.args, per_node=cost.profile.gpus_per_node),
                    bytes_per_element=cost.e, chunks=int(chunks[1:]))
    return shape_plan(name, shape), shape


def _local_experts_s(cost) -> float:
    """Parm's "moe" recompute: the local experts' forward work on the rows the exchange
    received (layer.local: once per piece of the exchange), priced as the plan prices it."""
    from parm_trainer.moe.cost_model import _work_s, step_load, walk

    plan, shape = _chosen_shape(cost)
    seconds = 0.0
    for step, held in walk(plan, shape):
        load, _ = step_load(step, shape, held)
        if load.exchange or step.op == "expert":
            r = load.chunks
            seconds += r * _work_s(load.flops / r, load.moved / r, cost.profile, load.gemms)
    return seconds * cost.profile.layer[1]


def _shared_expert_s(cost) -> float:
    from parm_trainer.moe.cost_model import shared_expert_s

    return shared_expert_s(_chosen_shape(cost)[1], cost.profile)[0]


def full(args, runs: list, kept_input: float) -> list:
    """runs with full recompute's pieces: a recomputed unit keeps kept_input (on its first
    layer) and the rest again while its backward runs (on its last layer's recompute_bytes),
    and its layers run their forward again in the backward."""
    if getattr(args, "recompute_granularity", None) != "full":
        return runs
    size, out = args.recompute_num_layers, []
    for run in runs:
        layers = [i for i, p in enumerate(run) if p.kind in ("t", "m")]
        if args.recompute_method == "uniform":
            units = [layers[i:i + size] for i in range(0, len(layers), size)]
        else:
            units = [[i] for i in layers[:size]]
        run = list(run)
        for unit in units:
            again = sum(run[i].activation_bytes for i in unit) - kept_input
            for position, i in enumerate(unit):
                p = run[i]
                run[i] = replace(p, activation_bytes=kept_input if position == 0 else 0.0,
                                 recompute_bytes=again if i == unit[-1] else 0.0,
                                 backward_s=p.backward_s + p.forward_s)
        out.append(run)
    return out


def transient(run: list) -> float:
    """The most a chunk's saved bytes grow while one recomputed part's backward runs: what
    that part holds again, less what the pieces after it (their backward done) have let go."""
    most, after = 0.0, 0.0
    for p in reversed(run):
        most = max(most, p.recompute_bytes - after)
        after += p.activation_bytes
    return most
