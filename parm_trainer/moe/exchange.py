"""The exact expert exchange of s1 and s2 (--moe-parm-exchange exact, the default).

The padded exchange (layer.py, --moe-parm-exchange padded) sends the dispatched (E, C, M)
layout: every expert padded to the capacity C, a token routed to k experts of one EP rank sent
k times and its k outputs sent back. This one sends what the routing needs and nothing else:

1. route: each token's routing weight for every expert it keeps, -1 for the others (weights
   are softmax probabilities, never negative, so the sign is the expert-id mask).
2. per piece of the tokens (r = the layer's `chunks` contiguous spans) and EP rank d: the tokens
   that go to any of d's local experts, once each, with their L = E / EP local weights as L
   extra columns (one row of M + L values per token and destination).
3. counts first: one AllGather over the EP x ESP group of every rank's rows per EP rank and
   (token, expert) pairs per expert, per piece (the only per-call agreement; dropless needs no
   capacity, so no all-reduce across the stage). It is also the only value read back to the
   host: every later count (rows to send, each local expert's rows, the relay's forwarding)
   is known from it, so the indices are taken with torch.nonzero_static and a GPU never
   waits for the host in between. s1's load-balancing loss sends its per-expert counts along
   instead of all-reducing them over MP itself (aux_loss.py).
4. per piece: AlltoAll-v (EP) of exact counts, ESP-AllGather-v, each local expert on its rows
   (a row is expanded to the experts its mask names), the outputs summed per row with their
   weights, ESP-ReduceScatter-v, AlltoAll-v back: one row per token and EP rank.
5. the rows are added into their tokens (the combine). With the MP group in the exchange
   (s2), each piece's combined tokens are then gathered over MP, overlapped with the pieces
   still on the wire.

Local first (--moe-parm-local-first) and the node relay (node_relay.py): docs/exchange.md.
"""

from __future__ import annotations

import functools
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
    kind: str = "all"  # "all" destinations, "remote" (all but this EP rank) or "local" (it)
    send: list = None    # rows to each destination of the first hop (EP ranks, or nodes)
    recv: list = None    # rows from each of them
    esp: list = None     # rows each ESP rank receives (the ESP AllGather's counts)
    experts: list = None  # (row, expert) pairs of each local expert once the ESP gather is in
    fwd_send: list = None  # relayed: rows forwarded to each EP rank of this node
    fwd_recv: list = None  # relayed: rows forwarded to this rank by each EP rank of its node
    token: torch.Tensor = None  # (rows,) token of each row sent, rows ordered by destination
    weights: torch.Tensor = None  # (rows, L or R L) the destination's local weights of it


@dataclass
class _Masks:
    """Where each token goes: to EP ranks (goes), to first-hop destinations (hop_goes: EP
    ranks, or nodes where relayed) with their weights (hop), and to experts (kept)."""
    goes: torch.Tensor      # (n, EP)
    hop_goes: torch.Tensor  # (n, EP or N)
    hop: torch.Tensor       # (n, EP or N, L or R L)
    kept: torch.Tensor      # (n, E)


def _masks(routed: Routed, ep: int, relay) -> _Masks:
    # explicit widths, not -1: a piece may hold no token (n = 0)
    n, experts = routed.weights.shape
    kept = routed.weights >= 0
    goes = kept.view(n, ep, experts // ep).any(dim=-1)
    if relay is None:
        return _Masks(goes, goes, routed.weights.view(n, ep, experts // ep), kept)
    return _Masks(goes, goes.view(n, relay.nodes, ep // relay.nodes).any(dim=-1),
                  routed.weights.view(n, relay.nodes, experts // relay.nodes), kept)


def _agree_counts(pieces: list, masks: _Masks, ep: int, esp: int, me_ep: int, me_esp: int,
                  relay, extra=None):
    """Fill each piece's counts from one AllGather over the EP x ESP group of every rank's rows
    per EP rank, (token, expert) pairs per expert (and, relayed, rows per node) of each piece,
    tagged with its sender's EP and ESP ranks: this rank's own send counts, what it receives,
    what each local expert computes, and the relay's in-node forwarding. The gathered table is
    the only thing read back to the host. `extra` (1-D int64, one length on every rank) rides
    along: returns every rank's, (W, len) in group rank order, on its device (else None)."""
    def per_piece(mask):  # (P, columns): each piece's tokens per column of mask
        return torch.stack([mask.narrow(0, p.offset, p.size).sum(dim=0) for p in pieces])

    count, experts = len(pieces), masks.kept.shape[1]
    parts = [per_piece(masks.goes), per_piece(masks.kept)]
    if relay is not None:
        parts.append(per_piece(masks.hop_goes))
    me = torch.tensor([me_ep, me_esp], dtype=torch.int64, device=masks.goes.device)
    if extra is not None:
        parts.append(extra)
    local = torch.cat([me] + [part.to(torch.int64).view(-1) for part in parts])
    gathered = cu.gather_counts(local, parallel_state.get_expert_tensor_and_model_parallel_group())
    ours = local.numel() - (0 if extra is None else extra.numel())  # the columns read here
    rows, extras = gathered[:, :ours].cpu(), (None if extra is None else gathered[:, ours:])
    cut = [2, 2 + count * ep, 2 + count * (ep + experts)]
    table = torch.zeros(ep, esp, count, ep, dtype=torch.int64)  # sender's rows per EP rank
    table[rows[:, 0], rows[:, 1]] = rows[:, cut[0]:cut[1]].view(-1, count, ep)
    pairs = torch.zeros(ep, esp, count, experts, dtype=torch.int64)  # and pairs per expert
    pairs[rows[:, 0], rows[:, 1]] = rows[:, cut[1]:cut[2]].view(-1, count, experts)
    into_me = table[..., me_ep]  # (EP sender, ESP rank, P): rows for EP rank me_ep
    width = experts // ep
    mine = pairs[..., me_ep * width:(me_ep + 1) * width]  # (EP sender, ESP rank, P, L)
    only = {"all": slice(None), "local": [me_ep],
            "remote": [s for s in range(ep) if s != me_ep]}  # the senders each kind takes
    if relay is not None:
        hops = masks.hop_goes.shape[1]
        by_node = torch.zeros(ep, esp, count, hops, dtype=torch.int64)  # sender's rows per node
        by_node[rows[:, 0], rows[:, 1]] = rows[:, cut[2]:].view(-1, count, hops)
        per, node, pos = relay.per_node, relay.node, relay.position
        at = lambda position: [a * per + position for a in range(relay.nodes)]  # noqa: E731
        relayed = table[at(pos), me_esp]  # (N senders at my position, P, EP)
    for i, piece in enumerate(pieces):
        senders = only[piece.kind]
        piece.esp = into_me[senders, :, i].sum(dim=0).tolist()
        piece.experts = mine[senders, :, i].sum(dim=(0, 1)).tolist()
        if relay is None:
            keep = torch.zeros(ep, dtype=torch.bool)
            keep[senders] = True
            piece.send = table[me_ep, me_esp, i].where(keep, 0).tolist()
            piece.recv = into_me[:, me_esp, i].where(keep, 0).tolist()
            continue
        piece.send = by_node[me_ep, me_esp, i].tolist()
        piece.recv = by_node[at(pos), me_esp, i, node].tolist()
        piece.fwd_send = relayed[:, i, node * per:(node + 1) * per].sum(dim=0).tolist()
        piece.fwd_recv = [int(into_me[at(j), me_esp, i].sum()) for j in range(per)]
    return extras


def _at(x, first, second=None):
    """x[first] (or x[first, second]) by index_select, whose backward adds each row back in
    place (index_add); advanced indexing's backward is an accumulating index_put, which sorts
    its indices (several times slower on CPU)."""
    if second is None:
        return x.index_select(0, first)
    return x.reshape(-1, *x.shape[2:]).index_select(0, first * x.shape[1] + second)


def _nonzero(mask, count: int):
    """The (row, column) indices of mask's True entries in row-major order, whose number
    (`count`) the host already knows: no read-back to the host (torch.nonzero waits for one).
    Each made contiguous: index_select with a strided index (a column of nonzero's (N, 2))
    took its rows 2.4 x slower on CPU (8192 rows of 256 floats: 0.76 against 0.32 ms)."""
    return tuple(index.contiguous() for index in
                 torch.nonzero_static(mask, size=count).unbind(dim=1))


def _rows(piece: _Piece, masks: _Masks, me: int) -> None:
    """The piece's rows to send: to each first-hop destination its tokens, once each, with that
    destination's weights (a local piece: only this EP rank `me`; a remote one: all others)."""
    goes = masks.hop_goes.narrow(0, piece.offset, piece.size).t()
    if piece.kind != "all":
        keep = torch.zeros(goes.shape[0], 1, dtype=torch.bool, device=goes.device)
        keep[me] = True
        goes = goes & (keep if piece.kind == "local" else ~keep)
    dest, token = _nonzero(goes, sum(piece.send))
    piece.token = token + piece.offset
    piece.weights = _at(masks.hop, piece.token, dest)


def _forward_in_node(rows, piece, relay, hidden):
    """The relay's in-node hop: each row received over the link (M + R L wide) to each EP rank
    of this node whose experts it names, with that rank's L weights. Returns the rows this
    rank receives and, to sum the outputs back, the row each forwarded one came from."""
    weights = rows[:, hidden:]  # (rows, R L), no -1: no row may have come over the link
    weights = weights.view(rows.shape[0], relay.per_node, weights.shape[1] // relay.per_node)
    rank, row = _nonzero((weights >= 0).any(dim=-1).t(), sum(piece.fwd_send))
    payload = torch.cat([_at(rows.narrow(1, 0, hidden), row), _at(weights, row, rank)],
                        dim=-1)
    counts = cu.counts_of("alltoall", relay.position, send=piece.fwd_send,
                          recv=piece.fwd_recv)
    return cu.run(payload, counts, relay.intra, "ep_node"), row


def _back_in_node(out, row, received: int, piece, relay):
    """The in-node hop back: each forwarded row's output to the relay, summed per link row."""
    back = cu.run(out, cu.counts_of("alltoall", relay.position, send=piece.fwd_recv,
                                    recv=piece.fwd_send), relay.intra, "ep_node")
    return back.new_zeros(received, back.shape[1]).index_add(0, row, back)


def _experts_on_rows(layer, x, w, counts: list):
    """Rows x (T, M) with their local weights w (T, L): each row through the local experts its
    weights name (counts: the rows of each, known on the host), summed with those weights ->
    (T, M), partial sums over ESP. The weights go to the experts as megatron's dispatchers pass
    the routing probabilities (applied to the activation, and to fc2's bias): p * expert(x), in
    one multiply the experts do anyway. Local work: under "moe" recompute only x and w are kept
    (layer.local)."""
    return layer.local(functools.partial(_rows_through_experts, layer, counts=counts), x, w)


def _rows_through_experts(layer, x, w, counts: list):
    hidden = x.shape[1]
    expert, row = _nonzero((w >= 0).t(), sum(counts))  # grouped by expert
    out = layer.run_experts(_at(x, row), counts, _at(w, row, expert))
    return x.new_zeros(x.shape[0], hidden).index_add(0, row, out)


def _esp_experts(layer, rows, p: _Piece, hidden, esp_group, me_esp):
    """ESP-AllGather-v of a piece's received rows, the local experts on them, and the partial
    sums' ESP-ReduceScatter-v: this rank's rows' outputs (T, M)."""
    rows = cu.run(rows, cu.counts_of("allgather", me_esp, counts=p.esp), esp_group, "esp")
    out = _experts_on_rows(layer, rows.narrow(1, 0, hidden),
                           rows.narrow(1, hidden, rows.shape[1] - hidden), p.experts)
    return cu.run(out, cu.counts_of("reducescatter", me_esp, counts=p.esp), esp_group, "esp")


def _only_here(layer, tokens, masks: _Masks, p: _Piece):
    """A piece's outputs (size, M) where nothing is exchanged (EP 1, ESP 1): the local experts
    on its tokens themselves, without the rows an exchange would send (on one rank, the copies
    of every token and its weights that made the layer 1.07 x megatron's allgather
    dispatcher)."""
    if sum(p.send) == p.size:  # every token kept (dropless): the piece as it is
        return _experts_on_rows(layer, tokens.narrow(0, p.offset, p.size),
                                masks.hop.narrow(0, p.offset, p.size)[:, 0], p.experts)
    _rows(p, masks, 0)  # the tokens kept (some dropped by the capacity)
    out = _experts_on_rows(layer, _at(tokens, p.token), p.weights, p.experts)
    return out.new_zeros(p.size, out.shape[1]).index_add(0, p.token - p.offset, out)


def _pieces(n: int, chunks: int, local_first: bool) -> list:
    """The exchange's pieces of n tokens: `chunks` spans to every destination, or, local
    first, the spans' rows to the other EP ranks and this rank's own rows in two halves (the
    first computed while the remote pieces travel out, the second while they come back)."""
    spans = comm.piece_spans(n, chunks)
    if not local_first:
        return [_Piece(*span) for span in spans]
    return ([_Piece(*span, "remote") for span in spans]
            + [_Piece(*span, "local") for span in comm.piece_spans(n, 2)])


class ExactExchange:
    """The exact exchange (and the direct one: no relay) behind the four methods the layer's
    executor calls, as padded_exchange.PaddedExchange has them."""

    def __init__(self, layer):
        self.layer = layer

    def dispatch(self, tokens, probs, routing_map):
        """Mark the kept (token, expert) pairs: all of them dropless, else those within the
        capacity of one gate call (layer.slots). No routing is left for the combine."""
        keep = routing_map
        if self.layer.config.moe_expert_capacity_factor is not None:
            _, _, keep = self.layer.slots(routing_map)
        return route(tokens, probs, keep), None

    def split_capacity(self, routed: Routed) -> Routed:
        """s2's MP split: this MP rank's block of the tokens."""
        return routed.split(self.layer.groups["mp"], "mp")

    def run(self, routed: Routed, gather_mp: bool, shared=None):
        return exchange(self.layer, routed, gather_mp, shared)

    def combine(self, out, routing):
        return out  # the exchange added every row into its token already


def exchange(layer, routed: Routed, gather_mp: bool, shared=None):
    """The exact exchange of routed's tokens -> their MoE outputs (n, M), or with gather_mp
    every MP rank's, in MP rank order (G n, M). shared (the overlapped shared expert,
    shared_expert.Deferred) runs once every outbound piece is on the wire, and binds its
    backward once every piece's outputs are on their way back."""
    ep_group, esp_group, mp_group = (layer.groups[g] for g in ("ep", "esp", "mp"))
    ep, esp = layer.ep_size, comm.group_size(esp_group)
    me_ep = parallel_state.get_expert_model_parallel_rank()
    me_esp = parallel_state.get_expert_tensor_parallel_rank()
    tokens, hidden = routed.tokens, routed.tokens.shape[1]
    relay = layer.relay
    local_first = layer.local_first and relay is None and ep > 1
    pieces = _pieces(tokens.shape[0], layer.chunks, local_first)
    aux = layer.router.take_pending() if getattr(layer.router, "defer", False) else None
    if not pieces:
        out = tokens.new_zeros(tokens.shape[0] * (layer.mp_size if gather_mp else 1), hidden)
        return out if aux is None else layer.router.attach(aux, None, out)
    masks = _masks(routed, ep, relay)
    extras = _agree_counts(pieces, masks, ep, esp, me_ep, me_esp, relay,
                           None if aux is None else aux.counts())
    if ep == 1 and esp == 1 and relay is None and not gather_mp:  # nothing to exchange
        if shared is not None:
            shared.run()
        outs = [_only_here(layer, tokens, masks, p) for p in pieces]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return out if aux is None else layer.router.attach(aux, extras[layer.aux_rows].sum(0),
                                                           out)
    for p in pieces:
        _rows(p, masks, me_ep)
    link, me_link, name = ((ep_group, me_ep, "ep") if relay is None
                           else (relay.inter, relay.node, "ep_link"))
    payload = lambda p: torch.cat([_at(tokens, p.token),  # noqa: E731
                                   p.weights.to(tokens.dtype)], dim=-1)
    sent = [p for p in pieces if p.kind != "local"]
    local = [p for p in pieces if p.kind == "local"]
    outbound = []
    for p in sent:
        counts = cu.counts_of("alltoall", me_link, send=p.send, recv=p.recv)
        outbound.append(cu.start(payload(p), counts, link, name))
    if shared is not None:
        shared.run()
    computed = []  # the local pieces' (piece, outputs)
    for p in local[:1]:
        computed.append((p, _esp_experts(layer, payload(p), p, hidden, esp_group, me_esp)))
    inbound = []
    for p, started in zip(sent, outbound):
        rows = comm.finish(started)
        if relay is not None:
            received = rows.shape[0]
            rows, came_from = _forward_in_node(rows, p, relay, hidden)
        out = _esp_experts(layer, rows, p, hidden, esp_group, me_esp)
        if relay is not None:
            out = _back_in_node(out, came_from, received, p, relay)
        back = cu.counts_of("alltoall", me_link, send=p.recv, recv=p.send)
        inbound.append(cu.start(out, back, link, name))
    if shared is not None:
        shared.bind()
    for p in local[1:]:
        computed.append((p, _esp_experts(layer, payload(p), p, hidden, esp_group, me_esp)))
    base = tokens.new_zeros(tokens.shape[0], hidden) if computed else None  # the local rows
    for p, out in computed:
        base = base.index_add(0, p.token, out)
    combined = []
    for p, started in zip(sent, inbound):
        rows = comm.finish(started)
        into = (rows.new_zeros(p.size, hidden) if base is None
                else base.narrow(0, p.offset, p.size))
        out = into.index_add(0, p.token - p.offset, rows)
        combined.append(comm.start("gather", out, mp_group, "mp") if gather_mp else out)
    if gather_mp:
        gathered = [comm.finish(started) for started in combined]  # each (G size, M), rank order
        combined = [piece.narrow(0, rank * p.size, p.size) for rank in range(layer.mp_size)
                    for piece, p in zip(gathered, sent)]
    out = torch.cat(combined, dim=0)
    # s1's aux loss, its counts summed over MP from the gathered table (aux_loss.py)
    return out if aux is None else layer.router.attach(aux, extras[layer.aux_rows].sum(0), out)
