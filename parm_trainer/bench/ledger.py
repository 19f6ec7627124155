"""The bytes of a row: sent (and received) per rank by collective kind for one iteration,
forward and backward, from parm_trainer.moe.comm.LEDGER (null for megatron's and DeepSpeed's
layers, whose collectives the ledger does not see); the bytes that leave the busiest node; and
the unique payload, the least any schedule must send off a node for this routing.
"""

from __future__ import annotations

import torch

from parm_trainer.bench.results import KINDS
from parm_trainer.node_relay import node_of_rank as node_of


def snapshot(field="sent"):
    """{"kind/group/phase": bytes} this rank's collectives moved since LEDGER.reset()."""
    from parm_trainer.moe.comm import LEDGER

    return {key: row[field] for key, row in LEDGER.totals(per_phase=True).items()}


def cross_node_bytes(local_bytes: dict, groups: dict) -> int:
    """Of the bytes this rank sent (ledger keys kind/group/phase), those that left its node:
    each collective's bytes times the share of the group's other ranks on other nodes."""
    me, total = torch.distributed.get_rank(), 0.0
    for key, sent in local_bytes.items():
        members = torch.distributed.get_process_group_ranks(groups[key.split("/")[1]])
        if len(members) > 1:
            remote = sum(node_of(r) != node_of(me) for r in members)
            total += sent * remote / (len(members) - 1)
    return int(total)


def busiest_node(per_rank: list) -> int:
    """The largest sum of per_rank over the ranks of one node."""
    nodes = {}
    for rank, value in enumerate(per_rank):
        nodes[node_of(rank)] = nodes.get(node_of(rank), 0) + value
    return max(nodes.values())


def bytes_report(per_rank):
    """per_rank: [{"kind/group/phase": sent}] -> {phase: {kind: [sent per rank]},
    "by_group": {phase: {"kind/group": [sent per rank]}}}."""
    world = len(per_rank)
    out = {phase: {kind: [0] * world for kind in KINDS} for phase in ("forward", "backward")}
    by_group = {"forward": {}, "backward": {}}
    for rank, rows in enumerate(per_rank):
        for key, sent in rows.items():
            kind, group, phase = key.split("/")
            out[phase][kind][rank] += sent
            by_group[phase].setdefault(f"{kind}/{group}", [0] * world)[rank] += sent
    out["by_group"] = by_group
    return out


def _unique_payload(args, replica) -> dict:
    """{node: bytes} this rank's tokens make leave each node at the least, from the routing
    itself: each of its tokens (its 1/MP block of the replica's, as s1 splits them) once to
    every other node holding one of its experts (EP ranks of this rank's EP group), hidden x
    4 bytes plus 4 bytes per routing weight that travels, out and back, forward and backward.
    A token's outbound payload and the backward's gradient of its return leave its own node;
    the return and the gradient of the payload leave the expert's node."""
    from megatron.core import parallel_state

    hidden, experts = args.hidden_size, args.num_experts
    routing = replica.routing_map(gate_calls=replica.mp_size)  # s1's gate calls
    if routing is None:
        return None
    mine = routing.chunk(replica.mp_size)[replica.mp_rank]
    ep_ranks = torch.distributed.get_process_group_ranks(
        parallel_state.get_expert_model_parallel_group())
    local = experts // len(ep_ranks)
    node_experts = {}
    for d, rank in enumerate(ep_ranks):
        node_experts.setdefault(node_of(rank), []).extend(range(d * local, (d + 1) * local))
    home, out = node_of(torch.distributed.get_rank()), {}
    for node, held in node_experts.items():
        if node == home:
            continue
        hits = mine[:, held]
        each = int(hits.any(dim=1).sum()) * 2 * hidden * 4 + int(hits.sum()) * 4
        out[home] = out.get(home, 0) + each
        out[node] = out.get(node, 0) + each
    return out


def unique_payload_bytes(args, replica):
    """The unique payload leaving the busiest node, summed over every rank's tokens."""
    unique = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(unique, _unique_payload(args, replica))
    if None in unique:  # no routing to count (forced balancing routes on random logits)
        return None
    nodes = {}
    for per_node in unique:
        for node, nbytes in per_node.items():
            nodes[node] = nodes.get(node, 0) + nbytes
    return max(nodes.values(), default=0)


def gather_row_bytes(local_sent, local_received, groups):
    """Every rank's ledger (sent, received) and the busiest node's outgoing bytes (None where a
    layer has no groups the ledger names)."""
    both = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(both, (local_sent, local_received))
    cross = [0] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(
        cross, cross_node_bytes(local_sent, groups) if groups is not None else None)
    return ([sent for sent, _ in both], [got for _, got in both],
            None if None in cross else busiest_node(cross))
