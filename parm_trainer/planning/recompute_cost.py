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
saved bytes at its worst, for the one micro-batch in its backward.
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
