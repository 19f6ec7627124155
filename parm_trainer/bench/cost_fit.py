"""The whole-layer terms of the cost model's profile (its "layer" entry: a factor on the
collectives' time, a factor on the compute's, a host cost per plan step and a cost per
collective call), fitted by non-negative least squares on measured forward + backward times
of bench_moe_layer's configurations (validate_cost_model; validation.py scores the fit).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from parm_trainer.moe.cost_model import plan_cost, shape_plan
from parm_trainer.moe.cost_profile import LAYER_DEFAULT, Profile
from parm_trainer.moe.cost_shape import LayerShape


def layer_shape(config: dict, bytes_per_element: int = 4) -> LayerShape:
    """The cost model's shape of one bench_moe_layer configuration (fp32)."""
    c = config
    return LayerShape(tokens=c["tokens_per_mp_group"], hidden=c["hidden_size"],
                      ffn=c["moe_ffn_hidden_size"], experts=c["num_experts"],
                      topk=c["moe_router_topk"], capacity_factor=c["moe_expert_capacity_factor"],
                      bytes_per_element=bytes_per_element, mp=c["tensor_model_parallel_size"],
                      ep=c["expert_model_parallel_size"], esp=c["expert_tensor_parallel_size"],
                      sequence_parallel=c["sequence_parallel"], chunks=c["moe_parm_chunks"],
                      dp=c.get("data_parallel_size", 1),
                      exact=c.get("moe_parm_exchange", "padded") != "padded")


# a step of each layer term for the finite differences of parts(): factors, then seconds
_TERM_STEPS = (1e-4, 1e-4, 1e-7, 1e-7)


def parts(name: str, shape: LayerShape, profile: Profile, terms=LAYER_DEFAULT) -> np.ndarray:
    """The features the layer terms weigh: d(predicted forward + backward seconds) / d(term)
    at `terms`, one per LAYER_KEYS entry. The prediction is piecewise linear in the terms and
    scales with them (every price is a term times an isolated price), so it equals
    parts . terms. Unpipelined, the parts are the isolated collective seconds, the isolated
    compute + memory seconds, plan steps x 3 (backward twice) and collective calls; in a
    pipeline they are those on its critical path at these terms."""
    plan = shape_plan(name, shape)

    def total(t):
        return plan_cost(plan, shape, replace(profile, layer=tuple(t)))["total_s"]

    base = total(terms)
    out = []
    for j, h in enumerate(_TERM_STEPS):
        t = list(terms)
        t[j] += h
        out.append((total(t) - base) / h)
    return np.array(out)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active set (Lawson-Hanson), for a handful of columns."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            step = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + step * (z - x)
            passive &= x > 1e-15
    return x


def fit_layer_terms(features, seconds) -> tuple:
    """(comm_factor, compute_factor, host_s_per_step, s_per_call) >= 0 minimising the squared
    relative error of features @ terms against seconds (small and large layers weigh alike)."""
    a = np.asarray(features, dtype=float)
    b = np.asarray(seconds, dtype=float)
    scale = 1.0 / b
    terms = _nnls(a * scale[:, None], b * scale)
    comm, compute, host, per_call = (float(v) for v in terms)
    return max(comm, 1e-6), max(compute, 1e-6), host, per_call


def fit_plans(samples, profile: Profile, rounds: int = 12) -> tuple:
    """Layer terms for [(schedule, LayerShape, measured seconds)]: fit_layer_terms on parts()
    taken at the current terms, repeated until the terms settle (a pipeline's critical path
    depends on them; unpipelined plans settle at once). Returns the terms of the lowest
    squared relative error seen."""
    seconds = np.array([s for _, _, s in samples])
    terms, best = LAYER_DEFAULT, None
    for _ in range(rounds):
        features = np.array([parts(n, shape, profile, terms) for n, shape, _ in samples])
        predicted = features @ np.array(terms)
        score = float(np.sum(((predicted - seconds) / seconds) ** 2))
        if best is None or score < best[0] - 1e-12:
            best = (score, terms)
        new = fit_layer_terms(features, seconds)
        if np.allclose(new, terms, rtol=1e-6, atol=1e-12):
            break
        terms = new
    return best[1]
