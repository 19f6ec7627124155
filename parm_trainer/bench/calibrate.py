"""What calibrate_comm measures (tools/calibrate_comm.py's docstring says how and why): every
collective kind on groups placed as a layout's MP, EP and ESP groups are (all at once), the
expert MLP's compute rate and the memory rate of token permutation, each fitted by alpha-beta
least squares (fit). calibration_report.py turns the fits into a cost Profile.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from parm_trainer.moe.cost_model import sent_bytes
from parm_trainer.moe.cost_profile import KINDS, fit_alpha_beta
from parm_trainer.moe.link_sharing import link_flows

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


def time_call(call, repeats, warmup, device, calls, group=None, active=True,
              pause=0.0) -> float:
    """Median seconds of one call: --warmup untimed calls, then `repeats` samples, each after a
    barrier on the group (and, with `pause`, that many seconds of quiet and a second barrier)
    and the mean of `calls` back-to-back calls; a sample's time is the slowest rank's. A rank
    not `active` joins the barriers and the MAX but calls nothing."""
    for _ in range(warmup if active else 0):
        call()
    _sync(device)
    times = torch.zeros(repeats, dtype=torch.float64, device=device)
    for i in range(repeats):
        dist.barrier(group=group)
        if pause:
            time.sleep(pause)
            dist.barrier(group=group)
        if not active:
            continue
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        _sync(device)
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


def measure_concurrency(repeats, warmup, device, calls) -> list:
    """[(k, time factor)]: the two largest GEMM cases timed with ranks 0..k-1 computing at
    once and the others waiting (k = 1, 2, 4, ... and the world), over the time with every
    rank computing. Ranks that share cores compute faster while fewer do (link_sharing.py);
    on GPUs the factors are about 1."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cases = sorted(gemm_cases(device), key=lambda case: case[0])[-2:]
    counts = sorted({min(2 ** i, world) for i in range(world.bit_length() + 1)})
    seconds = {}
    for k in counts:
        seconds[k] = sum(time_call(call, repeats, warmup, device, calls, active=rank < k)
                         for _, call in cases)
    return [(k, seconds[k] / seconds[world]) for k in counts]


# The MP collectives measured after compute: (kind, fp32 elements per rank) - a scalar
# AllReduce and sequence parallelism's AllGather and ReduceScatter of a small activation.
WAIT_CALLS = (("allreduce", 1), ("allgather", 32768), ("reducescatter", 65536))
# Seconds of compute before the call: a decoder's collective calls follow a few to tens of
# milliseconds of it on the shapes these machines train, and the wait grows with it.
WAIT_STRETCHES = (0.002, 0.008, 0.03)


def measure_sync_wait(repeats, warmup, device, calls, per_node, rounds=3) -> list:
    """[(chunk seconds, wait seconds)]: in every node's group of ranks at once (MP groups
    sit inside a node; the world where a node holds one rank), each WAIT_CALLS collective
    timed alone, a stretch of compute (a GEMM case repeated to about each WAIT_STRETCHES)
    alone, and the two back to back; the wait is what the pair takes beyond the two apart;
    all of it `rounds` times (a single point varies by milliseconds from one round to the
    next). At a collective after compute, ranks wait for the slowest to arrive (on shared
    cores, for one the scheduler left behind, longer the longer they computed), which a
    collective timed after a barrier never sees. Profile.layer's s_per_call, the median of
    the points, prices it at every collective call; on GPUs it is about 0."""
    world = dist.get_world_size()
    nodes = calibration_groups(world, per_node).get("intra", [list(range(world))])
    if len(nodes[0]) < 2:
        nodes = [list(range(world))]
    if nodes == [list(range(world))]:
        group, size = None, world
    else:
        group, _ = dist.new_subgroups_by_enumeration(nodes)
        size = len(nodes[0])
    gemm = [call for (_, call), (rows, m, h) in zip(gemm_cases(device), GEMM_SHAPES)
            if (rows, m, h) == (1024, 64, 128)][0]
    # the unit sets every stretch's length: never from one sample (a preempted one would make
    # all three stretches one GEMM long)
    unit = torch.tensor([time_call(gemm, max(5, repeats), max(1, warmup), device, calls)],
                        device=device)
    dist.all_reduce(unit, op=dist.ReduceOp.MAX)  # every rank repeats it as often
    chunks = []
    for target in WAIT_STRETCHES:
        def chunk(k=max(1, round(target / unit.item()))):
            for _ in range(k):
                gemm()
        chunks.append(chunk)
    points = []
    for _ in range(rounds):
        for kind, numel in WAIT_CALLS:
            collective = _op(kind, torch.ones(numel, device=device), group, size)
            alone = time_call(collective, repeats, warmup, device, calls)
            for call in chunks:
                chunk = time_call(call, repeats, warmup, device, calls)

                def pair(call=call, collective=collective):
                    call()
                    collective()
                both = time_call(pair, repeats, warmup, device, calls)
                points.append((chunk, max(0.0, both - chunk - alone)))
    return points


BURST_SIZES = (65536, 131072, 262144, 524288, 1048576, 2097152)
BURST_PAUSE = 0.05  # seconds of quiet before a send, as a pipeline stage's compute


def measure_burst(repeats, device, per_node, pause=BURST_PAUSE) -> list:
    """[(bytes, sustained s, after a pause s)]: rank 0 of the first node sends to rank 0 of
    the second (one flow on the link), each size timed back to back (the link busy) and
    after `pause` seconds of quiet (as a pipeline stage's P2P after its compute); [] on one
    node. burst_from() reads the bytes the link passes at once from them."""
    world = dist.get_world_size()
    if per_node >= world or world % per_node:
        return []
    rank = dist.get_rank()
    peer = {0: per_node, per_node: 0}.get(rank)
    points = []
    for nbytes in BURST_SIZES:
        buf = torch.ones(nbytes // 4, device=device)

        def send(buf=buf):
            (dist.send if rank == 0 else dist.recv)(buf, peer)
        points.append((nbytes, *(time_call(send, repeats, 0, device, 1, active=peer is not None,
                                           pause=gap) for gap in (0.0, pause))))
    return points


def burst_from(points) -> float:
    """Bytes a link passes at once after a pause, from measure_burst's points: each size's
    time saved after the pause at the sustained rate (the slope of the sustained times);
    the median over the sizes that exceeded it (the others only bound it from below), 0 when
    the pause saves nothing."""
    if len(points) < 2:
        return 0.0
    sizes = [b for b, _, _ in points]
    slope = statistics.linear_regression(sizes, [s for _, s, _ in points]).slope
    if slope <= 0:
        return 0.0
    saved = [max(0.0, (s - p) / slope) for _, s, p in points]
    over = [v for b, v in zip(sizes, saved) if b > 1.5 * v]
    return statistics.median(over) if over else max(saved)


def flow_groups(world, per_node, flows) -> list:
    """AllReduce groups across nodes that put `flows` flows on each node's link at once: with
    flows > 1, one ring of a rank per node for each position in the node; with 1, only the
    ring of the first position (the other ranks wait)."""
    nodes = world // per_node
    rings = [[p + j * per_node for j in range(nodes)] for p in range(per_node)]
    return rings if flows > 1 else rings[:1]


def measure_link_sharing(inter_groups, args, device, per_node) -> tuple:
    """(flows of the "inter" calibration, [(flows, AllReduce points)] with 1 flow and with a
    node's ranks' worth per node link), or (flows, []) where there is one rank per node."""
    world = dist.get_world_size()
    flows = link_flows(inter_groups, per_node)
    if per_node < 2 or world // per_node < 2:
        return flows, []
    quick = argparse.Namespace(sizes=args.sizes, repeats=max(3, args.repeats // 2),
                               warmup=1, calls=1)
    out = []
    for count in (1, per_node):
        groups = flow_groups(world, per_node, count)
        _, points = measure_groups(groups, quick, device, kinds=("allreduce",))
        out.append((link_flows(groups, per_node), points["allreduce"]))
    return flows, out


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


def fit(points, relative: bool = False):
    """(alpha, beta, r2, clamped) from [(sent bytes, seconds)]. relative: least squares of
    the relative errors, so that every size counts alike (the memory rate: its largest,
    cache-missing sizes vary up to 3 x between calibrations on shared cores, and would set
    the rate alone); r2 is of the raw points either way."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    spread = float(np.sum((y - y.mean()) ** 2))
    if relative and np.all(y > 0):
        design = np.stack([1.0 / y, x / y], axis=1)
        (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
        if alpha > 0 and beta > 0:
            residual = float(np.sum((y - alpha - beta * x) ** 2))
            return float(alpha), float(beta), 1.0 - residual / spread if spread else 1.0, False
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
        r2 = 1.0 - float(np.sum((y - alpha - beta * x) ** 2)) / spread if spread else 1.0
    return float(alpha), float(beta), float(r2), clamped


def calibrate(args, device, per_node):
    """Everything calibrate_comm measures, on every rank: (measured {link: (group size,
    {kind: points})}, local {"compute"|"memory": points, "concurrency": [(k, factor)],
    "sync_wait": [(chunk s, wait s)], "burst": [(bytes, sustained s, after a pause s)],
    "link_sharing": (inter flows, [(flows, points)])}, node_share per link, remote_peers per
    link)."""
    from parm_trainer.progress import Progress

    world = dist.get_world_size()
    measured, shares, remote = {}, {}, {}
    links = calibration_groups(world, per_node, args.group_size)
    progress = Progress(len(links) + 6, "calibrate_comm", enabled=dist.get_rank() == 0)
    for link, groups in links.items():
        measured[link] = measure_groups(groups, args, device)
        shares[link], remote[link] = node_share(groups, per_node), remote_peers(groups, per_node)
        progress.done(f"{link} collectives ({len(groups)} group(s) of {len(groups[0])})")
    local = {}
    for name, cases in (("compute", gemm_cases), ("memory", memory_cases)):
        local[name] = measure_local(cases(device), args.repeats, args.warmup, device, args.calls)
        progress.done(f"{name} rate")
    local["concurrency"] = measure_concurrency(max(3, args.repeats // 2), 1, device,
                                               max(1, args.calls // 2))
    progress.done("compute with fewer ranks at once")
    local["sync_wait"] = measure_sync_wait(max(5, args.repeats), 1, device,
                                           max(4, args.calls), per_node)
    progress.done("waits at a collective after compute")
    local["link_sharing"] = (measure_link_sharing(links["inter"], args, device, per_node)
                             if "inter" in links else (1, []))
    progress.done("link sharing (AllReduce with 1 and more flows per node)")
    local["burst"] = measure_burst(max(5, args.repeats), device, per_node)
    progress.done("the link's burst (sends after a pause)")
    return measured, local, shares, remote
