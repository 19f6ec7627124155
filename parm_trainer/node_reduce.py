"""Data-parallel gradients all-reduced node by node on gloo, where a DP group spans nodes.

gloo's all-reduce is one ring over the group's ranks in rank order: with D ranks on N nodes,
each node's link carries 2 (D-1)/D of the tensor's bytes each way (1.75 x on 2 x 4). Node by
node, the rank at position p of a node gets the p-th R-th of the tensor from each rank of its
node (an AlltoAll inside the node) and sums them, all-reduces the sum with the ranks at position
p on the other nodes (the link: 2 (N-1)/N of the bytes in all, 1.0 x on 2 x 4), and the node's
ranks gather the R sums (an AllGather inside the node). NCCL's tree does as much over the nodes
on GPUs; this is gloo's (CPU clusters, the emulated cluster). The sums are every rank's
gradient summed in another order (fp32 rounding, nothing else).

It applies on the gloo backend to a data-parallel group (dense or expert) spanning N >= 2 nodes
with the same R >= 2 of its ranks on each (node_relay.layout), for megatron-core's float32 SUM
all-reduce (not the distributed optimizer's reduce-scatter); --no-grad-reduce-by-node turns it
off. Asynchronous all-reduces run in order on one thread of this module, the only user of the
groups built here, so every rank issues their collectives in the same order.

    build(args)                                  collective, at start-up (parallel.py)
    reducer(group) -> NodeReduce | None          the reduction of a DP group, where it applies
    NodeReduce.all_reduce(tensor, async_op)      -> a handle with wait(), or None when done
"""

from __future__ import annotations

import datetime
import queue
import threading
from dataclasses import dataclass

import torch

from parm_trainer import node_relay

_STATE: dict = {}


@dataclass(frozen=True)
class NodeReduce:
    per_node: int  # R: the group's ranks on each node
    position: int  # this rank's position among them
    intra: object  # the group's ranks on this node (rank order: position p is group rank p)
    inter: object  # the group's ranks at this position on every node

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Sum tensor (contiguous float32) over the group, in place."""
        if not async_op:
            self._reduce(tensor)
            return None
        return _worker().submit(self._reduce, tensor)

    def _reduce(self, tensor: torch.Tensor) -> None:
        dist, per = torch.distributed, self.per_node
        flat = tensor.view(-1)
        even = flat.numel() // per * per
        body, tail = flat[:even], flat[even:]
        if even:  # rank p gets every node rank's p-th share (one AlltoAll), sums it, ...
            shares = torch.empty_like(body)
            dist.all_to_all_single(shares, body, group=self.intra)
            mine = shares.view(per, -1).sum(0)
            dist.all_reduce(mine, group=self.inter)  # ... over the nodes, and gathers the sums
            dist.all_gather_into_tensor(body, mine, group=self.intra)
        if tail.numel():  # fewer elements than ranks on a node
            dist.all_reduce(tail, group=self.intra)
            dist.all_reduce(tail, group=self.inter)


class _Handle:
    def __init__(self):
        self.done, self.error = threading.Event(), None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class _Worker:
    """One thread running the asynchronous reductions in the order they were submitted."""

    def __init__(self):
        self.jobs = queue.SimpleQueue()
        threading.Thread(target=self._run, name="parm-node-reduce", daemon=True).start()

    def submit(self, work, tensor) -> _Handle:
        handle = _Handle()
        self.jobs.put((work, tensor, handle))
        return handle

    def _run(self) -> None:
        while True:
            work, tensor, handle = self.jobs.get()
            try:
                work(tensor)
            except BaseException as error:  # handed to the waiting thread
                handle.error = error
            handle.done.set()


def _worker() -> _Worker:
    if "worker" not in _STATE:
        _STATE["worker"] = _Worker()
    return _STATE["worker"]


def build(args) -> None:
    """Create the groups of every data-parallel group (dense and expert) that spans nodes
    (collective over the world: every rank creates every group, in the same order)."""
    from megatron.core import parallel_state

    _STATE.pop("groups", None)
    if args.distributed_backend != "gloo" or not getattr(args, "grad_reduce_by_node", True) \
            or torch.distributed.get_world_size() == 1:
        return
    per_node = node_relay.ranks_per_node(args)
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)  # as megatron's groups
    found = {}
    for dp in (parallel_state.get_data_parallel_group(),
               parallel_state.get_expert_data_parallel_group()):
        everyone = [None] * torch.distributed.get_world_size()
        mine = torch.distributed.get_process_group_ranks(dp)
        torch.distributed.all_gather_object(everyone, mine)
        groups = sorted({tuple(ranks) for ranks in everyone})
        shape = node_relay.layout(groups, per_node)
        if shape is None:
            continue
        nodes, per = shape
        for ranks in groups:
            ranks, key = sorted(ranks), ranks  # torchrun fills nodes in rank order
            on_node = [ranks[n * per:(n + 1) * per] for n in range(nodes)]
            inter = [torch.distributed.new_group([node[p] for node in on_node], timeout=timeout)
                     for p in range(per)]
            intra = [torch.distributed.new_group(list(node), timeout=timeout)
                     for node in on_node]
            if list(key) == mine:
                me = ranks.index(torch.distributed.get_rank())
                found[key] = NodeReduce(per, me % per, intra[me // per], inter[me % per])
    _STATE["groups"] = found


def reducer(group) -> NodeReduce | None:
    """The node-by-node reduction of this process group, or None where it does not apply."""
    found = _STATE.get("groups")
    if not found or group is None:
        return None
    return found.get(tuple(torch.distributed.get_process_group_ranks(group)))


def reset() -> None:
    _STATE.pop("groups", None)
