"""Every collective kind timed on groups placed as a layout's MP, EP and ESP groups are (all at
once): the groups of each link class, the sizes, and the timing of a call."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from parm_trainer.moe.cost_model import sent_bytes
from parm_trainer.moe.cost_profile import KINDS


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _numel(nbytes: int, world: int) -> int:
    """float32 elements for ~nbytes, a positive multiple of world (blocks of equal size)."""
    return max(world, (nbytes // 4) // world * world)


def _tensor_bytes(kind: str, size: int, world: int) -> int:
    """Bytes of the tensor a rank passes in for a `size`-byte point: AllGather takes the local
    piece of a `size`-byte output, so that every kind moves tensors of the same sizes."""
    numel = _numel(size, world) // (world if kind == "allgather" else 1)
    return numel * 4


def collective_call(kind, x, group, world):
    """A callable issuing one `kind` collective on x (buffers allocated once)."""
    if kind == "alltoall":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if kind == "allgather":
        out = x.new_empty(x.numel() * world)
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    if kind == "reducescatter":
        out = x.new_empty(x.numel() // world)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if kind == "allreduce":
        return lambda: dist.all_reduce(x, group=group)
    raise ValueError(kind)


def time_call(call, repeats, warmup, device, calls, group=None, active=True,
              pause=0.0) -> float:
    """Median seconds of one call: --warmup untimed calls, then `repeats` samples, each after a
    barrier on the group (and, with `pause`, that many seconds of quiet and a second barrier)
    and the mean of `calls` back-to-back calls; a sample's time is the slowest rank's. A rank
    not `active` joins the barriers and the MAX but calls nothing."""
    for _ in range(warmup if active else 0):
        call()
    sync(device)
    times = torch.zeros(repeats, dtype=torch.float64, device=device)
    for i in range(repeats):
        dist.barrier(group=group)
        if pause:
            time.sleep(pause)
            dist.barrier(group=group)
        if not active:
            continue
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        sync(device)
        times[i] = (time.perf_counter() - t0) / calls
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(times.cpu().tolist())


def measure(group, sizes, repeats, warmup, device, calls=1, kinds=KINDS):
    """{kind: [(sent bytes, median seconds)]} on `group` (every rank of it calls this)."""
    world = dist.get_world_size(group)
    out = {}
    for kind in kinds:
        points = []
        for size in sizes:
            x = torch.ones(_tensor_bytes(kind, size, world) // 4, dtype=torch.float32,
                           device=device)
            seconds = time_call(collective_call(kind, x, group, world), repeats, warmup, device, calls,
                                group)
            points.append((sent_bytes(kind, x.nbytes, world), seconds))
        out[kind] = points
    return out


def calibration_groups(world, per_node, group_size=None) -> dict:
    """{link: [rank lists]} measured at once. Without group_size: the whole world (inter when
    it spans nodes) and, across nodes, every node's ranks (intra). With it: consecutive blocks
    of min(group_size, per_node) ranks inside each node (intra), and across nodes sets of
    min(group_size, nodes) ranks one node apart (inter), as the layout's groups place them."""
    nodes = world // per_node if world % per_node == 0 else 1
    if group_size is None:
        if per_node >= world:
            return {"intra": [list(range(world))]}
        out = {"inter": [list(range(world))]}
        if per_node >= 2:
            out["intra"] = [list(range(s, min(s + per_node, world)))
                            for s in range(0, world, per_node)]
        return out
    out = {}
    size = min(group_size, per_node)
    if size >= 2:
        out["intra"] = [list(range(s, s + size)) for s in range(0, world - size + 1, size)]
    across = min(group_size, nodes)
    if across >= 2:
        out["inter"] = [[first + j * per_node for j in range(across)]
                        for block in range(0, nodes, across)
                        for first in range(block * per_node, (block + 1) * per_node)]
    return out


def remote_peers(groups, per_node) -> float:
    """The mean share of a rank's peers that sit on other nodes, over groups measured at
    once (1 for --group-size groups across nodes)."""
    node_of = lambda r: r // per_node  # noqa: E731
    return statistics.fmean(sum(node_of(p) != node_of(r) for p in g) / (len(g) - 1)
                            for g in groups for r in g)


def node_share(groups, per_node) -> float:
    """For groups measured at once: how many of one node's ranks send at once, times the
    share of a rank's peers that sit on other nodes. A rank's fitted bandwidth times this is
    the rate through one node's network link (all of it when the groups cross nodes)."""
    node_of = lambda r: r // per_node  # noqa: E731
    busiest = max(sum(1 for g in groups for r in g if node_of(r) == n)
                  for n in {node_of(r) for g in groups for r in g})
    return busiest * remote_peers(groups, per_node)


def measure_groups(groups, args, device, kinds=KINDS):
    """(group size, {kind: points}) over `groups` (lists of ranks) measured at once, each
    point the slowest group's."""
    if groups == [list(range(dist.get_world_size()))]:
        return len(groups[0]), measure(dist.group.WORLD, args.sizes, args.repeats,
                                       args.warmup, device, args.calls, kinds)
    members = sorted(r for g in groups for r in g)
    extra = [[r] for r in range(dist.get_world_size()) if r not in members]
    mine, _ = dist.new_subgroups_by_enumeration(groups + extra)
    size = dist.get_world_size(mine)
    if size > 1:
        points = measure(mine, args.sizes, args.repeats, args.warmup, device, args.calls,
                         kinds)
    else:
        points = {k: [(0, 0.0)] * len(args.sizes) for k in kinds}
    flat = torch.tensor([[t for _, t in points[k]] for k in kinds], dtype=torch.float64,
                        device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    size = len(groups[0])
    sent = {k: [sent_bytes(k, _tensor_bytes(k, b, size), size) for b in args.sizes]
            for k in kinds}
    return size, {k: list(zip(sent[k], flat[i].cpu().tolist())) for i, k in enumerate(kinds)}
