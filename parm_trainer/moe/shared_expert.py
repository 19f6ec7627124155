"""The shared expert in Parm's layer: megatron-core's SharedExpertMLP, placed by the layer.

Every token goes through the shared expert beside its routed experts, and its output is added to
theirs. megatron's MoELayer runs it before the router, or (--moe-shared-expert-overlap) splits it
into pieces that its alltoall dispatcher interleaves with the token exchange. Parm's layer calls
the whole module (its own TP collectives included) at one point of the plan: before the gate,
or, overlapped, once the exchange's outbound pieces are on the wire, so that its GEMMs fill the
time the link needs. Where the plan has no exchange to wait on (baseline, or a call with no
tokens), it runs at the end. The call is the same either way, so the two give the same output.
"""

from __future__ import annotations

import copy

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


class Deferred:
    """One forward's shared-expert output: computed now, or by run() (the exchange's hook)
    when overlapped, and at the latest by add_to()."""

    def __init__(self, module, hidden_states, overlap: bool):
        self.module, self.input, self.output = module, hidden_states, None
        if module is not None and not overlap:
            self.run()

    def run(self) -> None:
        if self.module is not None and self.output is None:
            self.output = self.module(self.input)

    def add_to(self, routed_output):
        if self.module is None:
            return routed_output
        self.run()
        return routed_output + self.output
