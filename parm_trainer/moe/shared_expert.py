"""The shared expert in Parm's layer: megatron-core's SharedExpertMLP, placed by the layer.

Every token goes through the shared expert beside its routed experts, and its output is added to
theirs. megatron's MoELayer runs it before the router, or (--moe-shared-expert-overlap) splits it
into pieces that its alltoall dispatcher interleaves with the token exchange. Parm's layer calls
the whole module (its own TP collectives included) at one point of the plan: before the gate,
or, overlapped, once the exchange's outbound pieces are on the wire, so that its GEMMs fill the
time the link needs. Where the plan has no exchange to wait on (baseline, or a call with no
tokens), it runs at the end. The call is the same either way, so the two give the same output.

Overlapped, its backward has a place of its own too. Autograd runs ready nodes latest-made
first, so a shared expert computed while the dispatch travels would have its backward run
after the experts', where only the last gradient pieces are left on the wire. Instead it is
computed on a graph of its own (its input detached), and a bridge node made where the exchange
has sent its outputs back (bind()) runs that graph's backward when autograd reaches it: once
every piece's gradient is on its way back to the experts, while they travel, the mirror of the
forward. The gradients are those of the one graph (the same calls, run from the bridge).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.spec_utils import build_module


def build(config, submodules, pg_collection):
    """megatron's shared expert for config (None without one), always with its own TP
    collectives: megatron's overlapped form leaves them to its dispatcher."""
    if config.moe_shared_expert_intermediate_size is None:
        return None
    own = copy.copy(config)
    own.moe_shared_expert_overlap = False
    return build_module(submodules.shared_experts, config=own, pg_collection=pg_collection,
                        gate=config.moe_shared_expert_gate)


class _Bridge(torch.autograd.Function):
    """The shared expert's output in the layer's graph: forward passes its value on; backward
    runs the shared expert's own graph with the incoming gradient (autograd re-entered, as
    megatron's activation checkpointing does) and returns its input's gradient."""

    @staticmethod
    def forward(ctx, hidden_states, value, deferred):
        ctx.deferred = deferred
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        deferred, ctx.deferred = ctx.deferred, None
        torch.autograd.backward(deferred.graph_output, grad)
        detached, deferred.graph_output, deferred.detached = deferred.detached, None, None
        return detached.grad, None, None


class Deferred:
    """One forward's shared-expert output: computed now, or by run() (the exchange's hook,
    once its pieces are on the wire) when overlapped, and at the latest by add_to(); bind()
    (the exchange's second hook) places the overlapped backward."""

    def __init__(self, module, hidden_states, overlap: bool):
        self.module, self.input, self.output = module, hidden_states, None
        self.graph_output = self.detached = None  # the overlapped shared expert's own graph
        if module is not None and not overlap:
            self.output = module(hidden_states)

    def run(self) -> None:
        if self.module is None or self.output is not None or self.graph_output is not None:
            return
        if not (torch.is_grad_enabled() and self.input.requires_grad):  # one graph will do
            self.output = self.module(self.input)
            return
        self.detached = self.input.detach().requires_grad_()
        self.graph_output = self.module(self.detached)

    def bind(self) -> None:
        """Place the overlapped shared expert's backward here in the layer's graph."""
        if self.graph_output is not None and self.output is None:
            self.output = _Bridge.apply(self.input, self.graph_output.detach(), self)

    def add_to(self, routed_output):
        if self.module is None:
            return routed_output
        self.run()
        self.bind()
        return routed_output + self.output
