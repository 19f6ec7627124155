"""s1's load-balancing loss with its token counts carried by the exact exchange's AllGather.

On split tokens (s1) megatron's router sums each expert's token count over the MP ranks for
the switch aux loss: a blocking all-reduce of its own in every MoE layer's forward, before the
exchange can start (on the emulated 2 x 2 cluster 2.2 ms of shape D's 16 ms). The exact
exchange gathers every EP x ESP rank's counts anyway (exchange.py, step 3). Where that group
holds the MP group (megatron-core builds both from consecutive ranks, so wherever MP divides
EP x ESP), DeferringRouter keeps the loss's scores and routing map instead, this rank's
per-expert counts ride in the exchange's AllGather, and the loss is computed from the gathered
table and attached to the exchange's output. The value and the gradient are the router's own:
the same megatron-core function on the same counts, and its autograd scaler only needs a
tensor downstream of the gate whose backward runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
from megatron.core.transformer.moe.router import TopKRouter


@dataclass
class Pending:
    """The aux loss of one gate call, waiting for its counts summed over MP."""
    scores: torch.Tensor       # (n, E): megatron's scores for the aux loss
    routing_map: torch.Tensor  # (n, E): the experts each token picks for it (before drops)

    def counts(self) -> torch.Tensor:
        """This rank's tokens per expert (int64), as megatron's router counts them."""
        return self.routing_map.sum(dim=0).to(torch.int64)


# router -> its deferred loss, per thread: micro-batches taking turns (turns.py) each have one
# (kept here, not on the router, so that a model stays deep-copyable)
_PENDING = threading.local()


def _pending() -> dict:
    if not hasattr(_PENDING, "by_router"):
        _PENDING.by_router = {}
    return _PENDING.by_router


class DeferringRouter(TopKRouter):
    """megatron-core's TopKRouter whose switch aux loss waits for the exchange when `defer`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.defer = False  # set by ParmMoELayer where its exchange carries the counts

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        if not self.defer or with_padding_mask or self.get_aux_loss_coeff("aux_loss") == 0:
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map,
                                           with_padding_mask=with_padding_mask)
        _pending()[id(self)] = Pending(scores_for_aux_loss, routing_map)
        return probs

    def take_pending(self) -> Pending | None:
        """This thread's deferred loss, if its last gate call left one (taken once)."""
        return _pending().pop(id(self), None)

    def attach(self, pending: Pending, mp_counts: torch.Tensor | None, activation):
        """activation with the deferred loss attached; mp_counts: each expert's tokens summed
        over the MP group (None: sum them here with the router's own all-reduce)."""
        if mp_counts is None:
            return super()._apply_aux_loss(activation, pending.scores, pending.routing_map)
        coeff = self.get_aux_loss_coeff("aux_loss")
        tokens = pending.routing_map.shape[0]
        aux = switch_load_balancing_loss_func(
            probs=pending.scores, tokens_per_expert=mp_counts.to(pending.scores.device),
            total_num_tokens=tokens * self.tp_cp_group.size(), topk=self.topk,
            num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff,
            fused=self.config.moe_router_fusion)
        return self.attach_and_log_load_balancing_loss(activation, coeff, aux,
                                                       "load_balancing_loss", self.tp_cp_group,
                                                       valid_token_count=tokens)
