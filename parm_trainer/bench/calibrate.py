"""What calibrate_comm measures (tools/calibrate_comm.py's docstring says how and why): every
collective kind on groups placed as a layout's MP, EP and ESP groups are (all at once), the
expert MLP's compute rate and the memory rate of token permutation, each fitted by alpha-beta
least squares (fit). calibration_report.py turns the fits into a cost Profile.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from parm_trainer.moe.cost_model import KINDS, fit_alpha_beta, sent_bytes

R2_MIN = 0.95
ALPHA_FLOOR = 1e-9   # s
BETA_FLOOR = 1e-15   # s/byte (1 PB/s)


def _sync(device):
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


def _op(kind, x, group, world):
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


def time_call(call, repeats, warmup, device, calls, group=None) -> float:
    """Median seconds of one call: --warmup untimed calls, then `repeats` samples, each after a
    barrier on the group and the mean of `calls` back-to-back calls; a sample's time is the
    slowest rank's."""
    for _ in range(warmup):
        call()
    _sync(device)
    times = torch.zeros(repeats, dtype=torch.float64, device=device)
    for i in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        _sync(device)
        times[i] = (time.perf_counter() - t0) / calls
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(times.cpu().tolist())


def measure(group, sizes, repeats, warmup, device, calls=1):
    """{kind: [(sent bytes, median seconds)]} on `group` (every rank of it calls this)."""
    world = dist.get_world_size(group)
    out = {}
    for kind in KINDS:
        points = []
        for size in sizes:
            x = torch.ones(_tensor_bytes(kind, size, world) // 4, dtype=torch.float32,
                           device=device)
            seconds = time_call(_op(kind, x, group, world), repeats, warmup, device, calls,
                                group)
            points.append((sent_bytes(kind, x.nbytes, world), seconds))
        out[kind] = points
    return out


# Expert-like GEMMs (rows x M) @ (M x H), forward only; FLOPs = 2 * rows * M * H.
GEMM_SHAPES = [(rows, m, h) for rows in (256, 1024, 4096) for m, h in ((64, 128), (256, 512))]
# Memory-bound work of the layer (token permutation, activation) on (rows x M) float32 tensors.
MEMORY_SHAPES = [(rows, m) for rows in (256, 1024, 4096, 16384) for m in (64, 256)]


def gemm_cases(device):
    """[(forward FLOPs, callable)]: an expert MLP as the layer runs it, fc1 -> GELU -> fc2 on
    (rows, M) forward and backward through autograd. The cost model prices a backward at twice
    its forward, so each call's time counts as three forwards (measure_local's `passes`)."""
    cases = []
    for rows, m, h in GEMM_SHAPES:
        x = torch.randn(rows, m, device=device, requires_grad=True)
        fc1 = torch.randn(h, m, device=device, requires_grad=True)
        fc2 = torch.randn(m, h, device=device, requires_grad=True)
        grad = torch.randn(rows, m, device=device)

        def call(x=x, fc1=fc1, fc2=fc2, grad=grad):
            out = torch.nn.functional.gelu(x @ fc1.t()) @ fc2.t()
            out.backward(grad)
            x.grad = fc1.grad = fc2.grad = None
        cases.append((2.0 * rows * m * h * 2, call))
    return cases


def memory_cases(device):
    """[(forward bytes read + written, callable)]: a row permutation as dispatch and combine
    do (index_select forward, index_add backward through autograd), counted like gemm_cases."""
    cases = []
    for rows, m in MEMORY_SHAPES:
        x = torch.randn(rows, m, device=device, requires_grad=True)
        perm = torch.randperm(rows, device=device)
        grad = torch.randn(rows, m, device=device)

        def call(x=x, perm=perm, grad=grad):
            x.index_select(0, perm).backward(grad)
            x.grad = None
        cases.append((2.0 * x.nbytes, call))
    return cases


def measure_local(cases, repeats, warmup, device, calls):
    """[(amount, median seconds / 3)] of forward + backward work run on every rank at once
    (ranks share this node's cores, as they do in a layer), a sample's time being the slowest
    rank's; / 3: the time of one forward when a backward costs two."""
    points = []
    for amount, call in cases:
        points.append((amount, time_call(call, repeats, warmup, device, calls) / 3))
    return points


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


def measure_groups(groups, args, device):
    """(group size, {kind: points}) over `groups` (lists of ranks) measured at once, each
    point the slowest group's."""
    if groups == [list(range(dist.get_world_size()))]:
        return len(groups[0]), measure(dist.group.WORLD, args.sizes, args.repeats,
                                       args.warmup, device, args.calls)
    members = sorted(r for g in groups for r in g)
    extra = [[r] for r in range(dist.get_world_size()) if r not in members]
    mine, _ = dist.new_subgroups_by_enumeration(groups + extra)
    size = dist.get_world_size(mine)
    if size > 1:
        points = measure(mine, args.sizes, args.repeats, args.warmup, device, args.calls)
    else:
        points = {k: [(0, 0.0)] * len(args.sizes) for k in KINDS}
    flat = torch.tensor([[t for _, t in points[k]] for k in KINDS], dtype=torch.float64,
                        device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    size = len(groups[0])
    sent = {k: [sent_bytes(k, _tensor_bytes(k, b, size), size) for b in args.sizes]
            for k in KINDS}
    return size, {k: list(zip(sent[k], flat[i].cpu().tolist())) for i, k in enumerate(KINDS)}


def fit(points):
    """(alpha, beta, r2, clamped) from [(sent bytes, seconds)]."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    alpha, beta, r2 = fit_alpha_beta(x, y)
    clamped = False
    if alpha <= 0 or beta <= 0:  # least squares under alpha, beta >= 0: on the boundary
        clamped = True
        if beta > 0:  # alpha at its floor, beta through the origin (a shaper's burst, or noise)
            alpha = ALPHA_FLOOR
            beta = max(float(np.dot(x, y - alpha) / np.dot(x, x)), BETA_FLOOR)
        else:         # no size dependence seen: beta at its floor, alpha the mean time
            beta = BETA_FLOOR
            alpha = max(float(np.mean(y - beta * x)), ALPHA_FLOOR)
        spread = float(np.sum((y - y.mean()) ** 2))
        r2 = 1.0 - float(np.sum((y - alpha - beta * x) ** 2)) / spread if spread else 1.0
    return float(alpha), float(beta), float(r2), clamped


def calibrate(args, device, per_node):
    """Everything calibrate_comm measures, on every rank: (measured {link: (group size,
    {kind: points})}, local {"compute"|"memory": points}, node_share per link, remote_peers per
    link)."""
    from parm_trainer.progress import Progress

    world = dist.get_world_size()
    measured, shares, remote = {}, {}, {}
    links = calibration_groups(world, per_node, args.group_size)
    progress = Progress(len(links) + 2, "calibrate_comm", enabled=dist.get_rank() == 0)
    for link, groups in links.items():
        measured[link] = measure_groups(groups, args, device)
        shares[link], remote[link] = node_share(groups, per_node), remote_peers(groups, per_node)
        progress.done(f"{link} collectives ({len(groups)} group(s) of {len(groups[0])})")
    local = {}
    for name, cases in (("compute", gemm_cases), ("memory", memory_cases)):
        local[name] = measure_local(cases(device), args.repeats, args.warmup, device, args.calls)
        progress.done(f"{name} rate")
    return measured, local, shares, remote
