"""Tokens each expert received, per MoE layer, counted over the whole global batch.

    counter = ExpertTokenCounter(model_chunks, args.num_layers, args.num_experts)
    ...train steps...
    counts = counter.collect()   # collective: (num_layers, num_experts) float64 tensor, then reset

Every router (megatron's TopKRouter, in ParmMoELayer and in megatron's own MoELayer alike) is
wrapped so that each training-time `routing` call adds its routing map's column sums (the token
assignments that survive capacity dropping) to a per-layer counter. Eval passes (no grad) are
not counted.

A rank's router sees either all of its micro-batch's tokens (S2, baseline: every MP rank gates
the same, replicated tokens) or a 1/MP slice (S1, megatron's dispatcher under sequence
parallelism); the router's tp_cp_group says which, because the router sums its load-balancing
statistics over exactly the ranks that split the tokens. Each rank therefore contributes its
counts divided by MP / |tp_cp_group| (the number of ranks holding the same tokens), and one
all-reduce over the world gives counts that do not depend on the layout.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from parm_trainer.parallel import rank_device


def _routers(model_chunks):
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                yield module


class ExpertTokenCounter:
    def __init__(self, model_chunks, num_layers: int, num_experts: int):
        self.routers = list(_routers(model_chunks))
        self.num_layers, self.num_experts = num_layers, num_experts
        self.counts = {}  # layer number (1-based, global) -> (E,) int64, on the router's device
        for router in self.routers:
            self._wrap(router)

    def _wrap(self, router) -> None:
        routing = router.routing

        def counted_routing(logits, *args, **kwargs):
            probs, routing_map = routing(logits, *args, **kwargs)
            if router.training and torch.is_grad_enabled():
                with torch.no_grad():
                    layer = router.layer_number
                    total = routing_map.sum(dim=0).to(torch.int64)
                    self.counts[layer] = self.counts.get(layer, 0) + total
            return probs, routing_map

        router.routing = counted_routing  # megatron's forward and ParmMoELayer both call this

    def _replication(self) -> int:
        if not self.routers:
            return 1
        mp = parallel_state.get_tensor_model_parallel_world_size()
        return mp // torch.distributed.get_world_size(self.routers[0].tp_cp_group)

    def reset(self) -> None:
        self.counts.clear()

    def collect(self) -> torch.Tensor:
        """Counts since the last collect, summed over ranks: (num_layers, E), row i = layer i+1
        (rows of dense layers stay zero). Collective: every rank must call it."""
        device = rank_device()
        table = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=device)
        for layer, counts in self.counts.items():
            table[layer - 1] += counts.to(device).double() / self._replication()
        torch.distributed.all_reduce(table)
        self.reset()
        return table.round().cpu()


def format_expert_tokens(table: torch.Tensor) -> str:
    """'layer 1: 130 126 125 131 | layer 3: ...' for the MoE layers of a collected table."""
    rows = [f"layer {i + 1}: " + " ".join(str(int(v)) for v in row.tolist())
            for i, row in enumerate(table) if row.sum() > 0]
    return " | ".join(rows)
