"""The exact expert exchange of s1 and s2 (--moe-parm-exchange exact, the default).

The padded exchange (layer.py, --moe-parm-exchange padded) sends the dispatched (E, C, M)
layout: every expert padded to the capacity C, a token routed to k experts of one EP rank sent
k times and its k outputs sent back. This one sends what the routing needs and nothing else:

1. route: each token's routing weight for every expert it keeps, -1 for the others (weights
   are softmax probabilities, never negative, so the sign is the expert-id mask).
2. per piece of the tokens (the layer's chunks; contiguous spans) and EP rank d: the tokens
   that go to any of d's local experts, once each, with their L = E / EP local weights as L
   extra columns (one row of M + L values per token and destination).
3. counts first: one AllGather of every rank's send counts over the EP x ESP group (the only
   per-call agreement; dropless needs no capacity, so no all-reduce across the stage).
4. per piece: AlltoAll-v (EP) of exact counts, ESP-AllGather-v, each local expert on its rows
   (a row is expanded to the experts its mask names), the outputs summed per row with their
   weights, ESP-ReduceScatter-v, AlltoAll-v back: one row per token and EP rank.
5. the rows are added into their tokens (the combine). With the MP group in the exchange
   (s2), each piece's combined tokens are then gathered over MP, overlapped with the pieces
   still on the wire.

Every piece's outbound AlltoAll is issued at once and later pieces travel while earlier ones
compute, as in the padded exchange; the backward mirrors it (comm.start/finish).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from parm_trainer.moe import comm
from parm_trainer.moe import comm_uneven as cu


@dataclass
class Routed:
    """Tokens (n, M) and their routing weights (n, E): >= 0 where kept, -1 elsewhere."""
    tokens: torch.Tensor
    weights: torch.Tensor

    def split(self, group, name) -> "Routed":
        """This rank's contiguous block of the tokens and weights, which every rank of `group`
        holds alike (s2's MP split); the backward all-gathers both grads, so every rank ends
        with the whole input and router gradients, as from the replicated computation."""
        hidden = self.tokens.shape[1]
        both = torch.cat([self.tokens, self.weights.to(self.tokens.dtype)], dim=-1)
        mine = comm.split(both, group, name, dim=0)
        return Routed(mine[:, :hidden], mine[:, hidden:])


def route(tokens, probs, keep) -> Routed:
    return Routed(tokens, torch.where(keep, probs, torch.full_like(probs, -1.0)))


@dataclass
class _Piece:
    offset: int
    size: int
    token: torch.Tensor  # (rows,) token of each row sent, rows ordered by destination
    weights: torch.Tensor  # (rows, L) the destination's local weights of that token
    send: list           # rows to each EP rank
    recv: list = None    # rows from each EP rank
    esp: list = None     # rows each ESP rank receives (the ESP AllGather's counts)


def _pieces(routed: Routed, ep: int, chunks: int) -> list:
    n, experts = routed.weights.shape
    local = routed.weights.view(n, ep, experts // ep)
    goes = (local >= 0).any(dim=-1)  # (n, EP): the token goes to some expert of that rank
    pieces = []
    for offset, size in comm.chunk_spans(n, chunks):
        dest, token = goes.narrow(0, offset, size).t().nonzero(as_tuple=True)
        token = token + offset
        pieces.append(_Piece(offset, size, token, local[token, dest],
                             torch.bincount(dest, minlength=ep)))
    return pieces


def _agree_counts(pieces: list, ep: int, esp: int, me_ep: int, me_esp: int) -> None:
    """Fill each piece's recv and esp counts from one AllGather of every rank's send counts
    over the EP x ESP group (each row tagged with its sender's EP and ESP ranks)."""
    sends = torch.stack([p.send for p in pieces]).to(torch.int64)  # (P, EP), on the device
    local = torch.cat([torch.tensor([me_ep, me_esp], dtype=torch.int64, device=sends.device),
                       sends.view(-1)])  # NCCL gathers device tensors only
    rows = cu.gather_counts(local, parallel_state.get_expert_tensor_and_model_parallel_group())
    rows, sends = rows.cpu(), sends.cpu()
    table = torch.zeros(ep, esp, len(pieces), ep, dtype=torch.int64)
    table[rows[:, 0], rows[:, 1]] = rows[:, 2:].view(-1, len(pieces), ep)
    into_me = table[..., me_ep]  # (EP sender, ESP rank, P): rows sent to EP rank me_ep
    for i, piece in enumerate(pieces):
        piece.send = sends[i].tolist()
        piece.recv = into_me[:, me_esp, i].tolist()
        piece.esp = into_me[:, :, i].sum(dim=0).tolist()


def _experts_on_rows(layer, rows, hidden):
    """rows (T, M + L): each row's tokens through the local experts its weights name, summed
    with those weights -> (T, M), partial sums over ESP."""
    x, w = rows[:, :hidden], rows[:, hidden:]
    mask = w >= 0
    expert, row = mask.t().nonzero(as_tuple=True)  # grouped by expert
    counts = mask.sum(dim=0)
    out, _ = layer.experts(x[row], counts, torch.ones(row.numel(), dtype=x.dtype,
                                                     device=x.device))
    weighted = out * w[row, expert].unsqueeze(-1)
    return x.new_zeros(x.shape[0], hidden).index_add(0, row, weighted)


def exchange(layer, routed: Routed, gather_mp: bool):
    """The exact exchange of routed's tokens -> their MoE outputs (n, M), or with gather_mp
    every MP rank's, in MP rank order (G n, M)."""
    ep_group, esp_group, mp_group = (layer.groups[g] for g in ("ep", "esp", "mp"))
    ep, esp = layer.ep_size, comm.group_size(esp_group)
    me_ep = parallel_state.get_expert_model_parallel_rank()
    me_esp = parallel_state.get_expert_tensor_parallel_rank()
    tokens, hidden = routed.tokens, routed.tokens.shape[1]
    pieces = _pieces(routed, ep, layer.chunks)
    if not pieces:
        return tokens.new_zeros(tokens.shape[0] * (layer.mp_size if gather_mp else 1), hidden)
    _agree_counts(pieces, ep, esp, me_ep, me_esp)
    outbound = []
    for p in pieces:
        payload = torch.cat([tokens[p.token], p.weights.to(tokens.dtype)], dim=-1)
        counts = cu.counts_of("alltoall", me_ep, send=p.send, recv=p.recv)
        outbound.append(cu.start(payload, counts, ep_group, "ep"))
    inbound = []
    for p, started in zip(pieces, outbound):
        rows = cu.run(comm.finish(started), cu.counts_of("allgather", me_esp, counts=p.esp),
                      esp_group, "esp")
        out = _experts_on_rows(layer, rows, hidden)
        out = cu.run(out, cu.counts_of("reducescatter", me_esp, counts=p.esp), esp_group, "esp")
        back = cu.counts_of("alltoall", me_ep, send=p.recv, recv=p.send)
        inbound.append(cu.start(out, back, ep_group, "ep"))
    combined = []
    for p, started in zip(pieces, inbound):
        rows = comm.finish(started)
        out = rows.new_zeros(p.size, hidden).index_add(0, p.token - p.offset, rows)
        combined.append(comm.start("gather", out, mp_group, "mp") if gather_mp else out)
    if not gather_mp:
        return torch.cat(combined, dim=0)
    gathered = [comm.finish(started) for started in combined]  # each (G size, M), rank order
    return torch.cat([piece.narrow(0, rank * p.size, p.size) for rank in range(layer.mp_size)
                      for piece, p in zip(gathered, pieces)], dim=0)
