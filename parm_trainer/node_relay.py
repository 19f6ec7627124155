"""Where the exact exchange relays through a node (exchange.py): its two process groups.

An EP group whose ranks sit on several nodes, several on each, would send a token routed to
experts on two ranks of one remote node over the node link twice. Relayed (DeepEP's two hops),
the token crosses once per destination node, to the EP rank at the sender's own position on
that node, which forwards it inside the node to the ranks whose experts it needs, and sums
their outputs before the one row goes back. This module finds where that applies and builds
the groups the two hops run on:

    inter  this rank's EP peers at its position on every node (node order): the link hop
    intra  the EP ranks of this rank's node (EP order): the in-node hop

Ranks per node: --ranks-per-node, else LOCAL_WORLD_SIZE (torchrun), else the whole world (one
node: no relay). torchrun numbers ranks node by node, so rank g sits on node g // ranks per
node. megatron-core orders expert ranks ESP fastest, then EP, then expert-DP, then PP, so an
EP group is [b + t + ESP j for j < EP]: its nodes never decrease along it. The relay applies
when every EP group spans N >= 2 nodes with the same R >= 2 ranks on each and top-k >= 2 (a
top-1 token goes to one rank: there is nothing to share); EP index d then sits on node d // R
at position d % R of it. new_group is collective over the world, so every rank builds every
group, in the same order, at start-up (parallel.initialize_distributed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class NodeRelay:
    nodes: int     # N: nodes this rank's EP group spans
    per_node: int  # R: its EP ranks on each
    node: int      # this rank's node among them (its index in `inter`)
    position: int  # this rank's position on its node (its index in `intra`)
    inter: object  # process group of the link hop (size N)
    intra: object  # process group of the in-node hop (size R)


_STATE: dict = {}


def ranks_per_node(args=None) -> int:
    """With args: --ranks-per-node, else LOCAL_WORLD_SIZE, else the world (args.world_size);
    without: what build() recorded for this job."""
    if args is None:
        import torch  # here: the layout checks run before torch is imported

        return _STATE.get("per_node") or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or \
            torch.distributed.get_world_size()
    return getattr(args, "ranks_per_node", None) or \
        int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or args.world_size


def node_of_rank(rank: int) -> int:
    """The node of a global rank, as this job's layout places it."""
    return rank // ranks_per_node()


def ep_groups(world: int, esp: int, ep: int) -> list:
    """Every EP group's global ranks in megatron-core's expert rank order."""
    return [[block + t + esp * j for j in range(ep)]
            for block in range(0, world, esp * ep) for t in range(esp)]


def layout(groups: list, per_node: int) -> Optional[tuple]:
    """(N, R) when every group spans N >= 2 nodes with R >= 2 of its ranks on each, else None."""
    shapes = set()
    for ranks in groups:
        nodes = [g // per_node for g in ranks]
        counts = {node: nodes.count(node) for node in nodes}
        if len(set(counts.values())) != 1:
            return None
        shapes.add((len(counts), len(ranks) // len(counts)))
    if len(shapes) != 1:
        return None
    nodes, per = shapes.pop()
    return (nodes, per) if nodes >= 2 and per >= 2 else None


def relay_size(args, per_node: int) -> int:
    """R, the EP ranks per node the exact exchange relays through with per_node ranks on each
    node, or 1 where it goes in one hop. Needs no process group (the cost model's shapes)."""
    ep, esp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if not args.num_experts or ep < 2 or args.moe_router_topk < 2 or \
            getattr(args, "moe_parm_exchange", "exact") != "exact":
        return 1
    found = layout(ep_groups(args.world_size, esp, ep), per_node)
    return found[1] if found else 1


def build(args) -> None:
    """Create the two hops' groups on every rank where the relay applies (collective)."""
    import torch
    from megatron.core import parallel_state

    _STATE.clear()
    _STATE["per_node"] = ranks_per_node(args)
    per = relay_size(args, _STATE["per_node"])
    if per == 1:
        return
    ep, esp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    groups = ep_groups(torch.distributed.get_world_size(), esp, ep)
    mine = torch.distributed.get_process_group_ranks(
        parallel_state.get_expert_model_parallel_group())
    if mine not in groups:
        raise RuntimeError(f"EP group {mine} is not megatron-core's expert rank order {groups}")
    nodes, me = ep // per, mine.index(torch.distributed.get_rank())  # me: this rank's EP index
    inter = intra = None
    for ranks in groups:
        for pos in range(per):  # the link hop: position pos on every node
            group = torch.distributed.new_group([ranks[node * per + pos] for node in range(nodes)])
            if ranks == mine and pos == me % per:
                inter = group
        for node in range(nodes):  # the in-node hop
            group = torch.distributed.new_group(ranks[node * per:(node + 1) * per])
            if ranks == mine and node == me // per:
                intra = group
    _STATE["relay"] = NodeRelay(nodes, per, me // per, me % per, inter, intra)


def current() -> Optional[NodeRelay]:
    """This rank's relay, or None where the exact exchange goes in one hop."""
    return _STATE.get("relay")


def reset() -> None:
    _STATE.clear()


def group_limit_note(args, per_node: int) -> Optional[str]:
    """The start-up line on group-limited routing: whether the routing groups lie within one EP
    rank or one node, which bounds how many of them (and so how many links) a token reaches;
    None without it. per_node: ranks per node."""
    groups, chosen = args.moe_router_num_groups, args.moe_router_group_topk
    if not args.num_experts or not chosen:
        return None
    experts, ep = args.num_experts, args.expert_model_parallel_size
    group, local = experts // groups, experts // ep
    ranks = ep_groups(args.world_size, args.expert_tensor_parallel_size, ep)[0]
    nodes = len({rank // per_node for rank in ranks})
    on_node = local * (ep // nodes)  # experts on each node of the EP group (contiguous)
    words = [f"group-limited routing: {groups} groups of {group} experts, {chosen} per token"]
    span = -(-group // local)  # EP ranks a group's experts lie on
    if ep > 1:
        reach = min(ep, chosen * span)
        words.append(f"{'each group on one EP rank' if span == 1 else f'a group on {span} EP ranks'}"
                     f", so a token goes to at most {reach} of the {ep} EP ranks"
                     + ("" if reach < ep else " (no limit)"))
    if nodes > 1 and on_node % group == 0:
        reach = min(chosen, nodes)
        words.append(f"each group on one node, so a token's rows go to at most {reach} of the "
                     f"{nodes} nodes of its EP group" + ("" if reach < nodes else " (no limit)"))
    elif nodes > 1:
        words.append(f"the groups do not line up with the {nodes} nodes of the EP group "
                     f"(--moe-router-num-groups {nodes} or a multiple would)")
    return "; ".join(words)
