"""A single-process MoE layer in plain torch, written from the definitions: the yardstick every
schedule (baseline, s1, s2) and megatron-core's own MoELayer are checked against.

    from parm_trainer.moe.reference import moe_reference
    ref = moe_reference(x, gate, fc1, fc2, topk=2, aux_loss_coeff=0.01)
    (ref.output * out_grad).sum().add(ref.aux_loss).backward()   # grads of x, gate, fc1, fc2

Shapes: x (T, M) tokens (sequence-major rows of an [S, B, M] activation), gate (E, M),
fc1 (E, H, M), fc2 (E, M, H). No biases.

Routing (megatron-core's score function "softmax"):
    logits = x @ gate.T                                           (T, E)
    the k largest logits of each token pick its experts;
    probs  = softmax over those k logits (the other experts get probability 0); with
             pre_softmax (--moe-router-pre-softmax, which top-1 needs: a softmax over one
             logit is 1 and has no gradient), the softmax over all E logits, kept at the k.
Capacity (optional, megatron-core's formula and "probs" drop policy): a gate call on n tokens
gives every expert C = ceil((n * k / E) * f) slots; if C < n, expert e keeps the C tokens with
the largest probs[:, e] and drops the rest of its tokens. `gate_calls` cuts the T tokens into
that many contiguous, equal gate calls (Parm's S1 gates each MP rank's 1/G of the tokens, and
megatron-core's router under sequence parallelism each MP rank's sequence shard), so capacity
is counted per call exactly as those layers count it. Dropless (f None) needs no capacity.
Experts: expert_e(x) = fc2[e] @ gelu(fc1[e] @ x), gelu = torch.nn.functional.gelu (erf form,
megatron-core's default activation).
Output:  y_t = sum over the experts e kept for token t of probs[t, e] * expert_e(x_t).

Load-balancing loss (megatron-core's "aux_loss", the Switch Transformer loss):
    scores  = softmax over ALL E logits of each token                      (T, E)
    count_e = number of tokens whose top-k experts include e (before any capacity drop)
    aux     = E / (k * T^2) * sum_e count_e * sum_t scores[t, e]
The counts are integers (no gradient); the gradient flows through the scores. T counts all the
tokens of the layer call, whichever ranks hold them. `raw_aux_loss` is aux before the
coefficient (what megatron-core logs as load_balancing_loss); `aux_loss` = coeff * aux is what
enters the backward pass: megatron-core attaches it to the routing probabilities with a
backward scale of 1 (MoEAuxLossAutoScaler.main_loss_backward_scale outside its pipeline
schedule), so a layer's total objective is  sum(y * dL/dy) + coeff * aux.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

ROUTER = "softmax over the top-k logits"
ROUTER_PRE_SOFTMAX = "softmax over all logits, taken at the top-k"
ACTIVATION = "gelu"


@dataclass
class ReferenceResult:
    output: torch.Tensor        # (T, M)
    raw_aux_loss: torch.Tensor  # aux before the coefficient (the logged load_balancing_loss)
    aux_loss: torch.Tensor      # coeff * aux: the term added to the backward objective
    probs: torch.Tensor         # (T, E) routing probabilities after capacity drops
    routing_map: torch.Tensor   # (T, E) bool, the (token, expert) pairs computed


def capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Slots per expert for one gate call on num_tokens tokens (megatron-core's expression,
    same operation order, so float rounding agrees)."""
    return math.ceil((num_tokens * topk / num_experts) * capacity_factor)


def route(logits: torch.Tensor, topk: int, pre_softmax: bool = False):
    """(probs (T, E), routing_map (T, E) bool): softmax over each token's top-k logits, or
    with pre_softmax the softmax over all its logits at its top k."""
    if pre_softmax:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)
        top_probs, top_index = torch.topk(scores, k=topk, dim=1)
    else:
        top_logits, top_index = torch.topk(logits, k=topk, dim=1)
        top_probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).to(logits.dtype)
    probs = torch.zeros_like(logits).scatter(1, top_index, top_probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_index, True)
    return probs, routing_map


def drop_over_capacity(probs: torch.Tensor, routing_map: torch.Tensor, topk: int,
                       capacity_factor: float, gate_calls: int = 1):
    """Apply the "probs" drop policy per gate call (contiguous equal chunks of the tokens)."""
    tokens, experts = probs.shape
    if tokens % gate_calls:
        raise ValueError(f"{tokens} tokens do not split into {gate_calls} gate calls")
    n = tokens // gate_calls
    cap = capacity(n, experts, topk, capacity_factor)
    if cap >= n:
        return probs, routing_map
    keep = torch.zeros_like(routing_map)
    for call in range(gate_calls):
        rows = slice(call * n, (call + 1) * n)
        best = torch.topk(probs[rows].detach(), k=cap, dim=0).indices  # (cap, E)
        keep[rows] = torch.zeros_like(routing_map[rows]).scatter(0, best, True)
    routing_map = routing_map & keep
    return probs * routing_map, routing_map


def switch_aux_loss(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """aux = E / (k * T^2) * sum_e count_e * sum_t softmax(logits)[t, e], before the coeff."""
    tokens, experts = logits.shape
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    chosen = torch.topk(scores, k=topk, dim=1).indices
    count = torch.zeros_like(scores).scatter(1, chosen, 1.0).sum(dim=0)  # no grad: integers
    return experts / (topk * tokens * tokens) * (count * scores.sum(dim=0)).sum()


def expert_forward(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                   activation: Callable = F.gelu) -> torch.Tensor:
    """fc2 @ act(fc1 @ x) for the rows of x; fc1 (H, M), fc2 (M, H)."""
    return activation(x @ fc1.t()) @ fc2.t()


def moe_reference(x: torch.Tensor, gate: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                  topk: int, aux_loss_coeff: float = 0.0,
                  capacity_factor: Optional[float] = None, gate_calls: int = 1,
                  activation: Callable = F.gelu, pre_softmax: bool = False) -> ReferenceResult:
    """The MoE layer of the module docstring on tokens x (T, M); differentiable in every
    tensor argument."""
    tokens, hidden = x.shape
    experts = gate.shape[0]
    if fc1.shape[0] != experts or fc2.shape[0] != experts:
        raise ValueError("gate, fc1 and fc2 must agree on the number of experts")
    logits = x @ gate.t()
    probs, routing_map = route(logits, topk, pre_softmax)
    if capacity_factor is not None:
        probs, routing_map = drop_over_capacity(probs, routing_map, topk, capacity_factor,
                                                gate_calls)
    output = x.new_zeros(tokens, hidden)
    for e in range(experts):
        rows = routing_map[:, e].nonzero(as_tuple=True)[0]
        if rows.numel() == 0:
            continue
        y = expert_forward(x[rows], fc1[e], fc2[e], activation)
        output = output.index_add(0, rows, y * probs[rows, e].unsqueeze(-1))
    raw = switch_aux_loss(logits, topk)
    return ReferenceResult(output, raw, aux_loss_coeff * raw, probs, routing_map)
