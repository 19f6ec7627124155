"""The padded exchange (--moe-parm-exchange padded, and always the baseline's dispatch and
combine): tokens dispatched into the fixed (E, C, M) layout of PARM.md, C the capacity of one gate
call (layer.slots), the capacity slots split over MP by s2, exchanged in the layer's pieces,
and combined with the routing probabilities. The exact exchange (exchange.py) has the same four
methods; ParmMoELayer builds one of the two and its executor calls them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parm_trainer.moe import comm


@dataclass
class Routing:
    """What the dispatch leaves for the combine: each kept (token, expert) pair's slot."""
    token_index: torch.Tensor
    slot: torch.Tensor
    weight: torch.Tensor
    num_tokens: int


class PaddedExchange:
    def __init__(self, layer):
        self.layer = layer

    def dispatch(self, tokens, probs, routing_map):
        """tokens (n, M) -> ((E, C, M) slots, Routing); a pair past the capacity is dropped."""
        experts = self.layer.num_experts
        capacity, position, keep = self.layer.slots(routing_map)
        token_index, expert_index = keep.nonzero(as_tuple=True)
        slot = expert_index * capacity + position[token_index, expert_index]
        dispatched = tokens.new_zeros(experts * capacity, tokens.shape[-1])
        dispatched = dispatched.index_copy(0, slot, tokens[token_index])
        routing = Routing(token_index, slot, probs[token_index, expert_index], tokens.shape[0])
        return dispatched.view(experts, capacity, -1), routing

    def split_capacity(self, x):
        """This MP rank's 1/G of the capacity slots (no communication)."""
        return comm.split(x, self.layer.groups["mp"], "mp", dim=1)

    def combine(self, expert_output, routing: Routing):
        """(E, C, M) -> (n, M): each slot's output weighted into its token."""
        flat = expert_output.reshape(-1, expert_output.shape[-1])
        weighted = flat[routing.slot] * routing.weight.unsqueeze(-1).to(flat.dtype)
        out = flat.new_zeros(routing.num_tokens, flat.shape[-1])
        return out.index_add(0, routing.token_index, weighted)

    def run(self, x, gather_mp: bool, shared=None):
        """The expert exchange of s1 (and s2, gather_mp) on (E, c, M) in the layer's pieces of
        the capacity slots. Every piece's AlltoAll is issued at once; while later pieces are
        on the wire, piece i is gathered over ESP, computed, reduce-scattered and sent back
        (and, for s2, gathered over MP). Slots are independent rows, so each piece is exactly
        the one-piece computation on its slots; the backward overlaps the same way
        (comm.start/finish). One piece runs each collective after the other. shared: the
        overlapped shared expert (shared_expert.Deferred), run once the pieces are out."""
        layer = self.layer
        ep, esp, mp = layer.groups["ep"], layer.groups["esp"], layer.groups["mp"]
        spans = comm.piece_spans(x.shape[1], layer.chunks)
        if not spans:  # no capacity slots (agreed on every rank): nothing to exchange
            return x
        outbound = [comm.start("alltoall", x.narrow(1, *span), ep, "ep") for span in spans]
        if shared is not None:
            shared.run()
        inbound = []
        for started in outbound:
            y = comm.all_gather(comm.finish(started), esp, "esp", dim=1)
            y = comm.reduce_scatter(layer.expert(y), esp, "esp", dim=1)
            inbound.append(comm.start("alltoall", y, ep, "ep"))
        if shared is not None:
            shared.bind()
        if not gather_mp:
            return torch.cat([comm.finish(started) for started in inbound], dim=1)
        gathers = [comm.start("gather", comm.finish(started), mp, "mp", dim=1)
                   for started in inbound]
        pieces = [comm.finish(started) for started in gathers]  # [rank 0's span | rank 1's ...]
        # the one-piece layout: each MP rank's slots together, pieces in order within them
        return torch.cat([piece.narrow(1, rank * size, size) for rank in range(layer.mp_size)
                          for piece, (_, size) in zip(pieces, spans)], dim=1)
