"""What the alpha-beta lines miss: the wait at a collective after compute (ranks arriving apart),
the link's burst (a send after a pause), and how the link is shared by several flows."""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from parm_trainer.bench.calibration.collectives import (calibration_groups, collective_call,
                                                        measure_groups, time_call)
from parm_trainer.bench.calibration.local import GEMM_SHAPES, gemm_cases
from parm_trainer.moe.link_sharing import link_flows


# The MP collectives measured after compute: (kind, fp32 elements per rank) - a scalar
# AllReduce and sequence parallelism's AllGather and ReduceScatter of a small activation.
WAIT_CALLS = (("allreduce", 1), ("allgather", 32768), ("reducescatter", 65536))
# Seconds of compute before the call: a decoder's collective calls follow a few to tens of
# milliseconds of it on the shapes these machines train, and the wait grows with it.
WAIT_STRETCHES = (0.002, 0.008, 0.03)


def stretch_repeats(unit: float) -> list:
    """How many GEMMs of `unit` seconds make each of WAIT_STRETCHES (at least one)."""
    return [max(1, round(target / unit)) for target in WAIT_STRETCHES]


def measure_sync_wait(repeats, warmup, device, calls, per_node, rounds=3) -> list:
    """[(stretch seconds, wait seconds)]: in every node's group of ranks at once (MP groups
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
    # the unit sets every stretch's length: never from one sample, nor from a rank the
    # scheduler left behind (either would make all three stretches one GEMM long); the fastest
    # rank's median, which every rank then repeats as often
    unit = torch.tensor([time_call(gemm, max(5, repeats), max(1, warmup), device, calls)],
                        device=device)
    dist.all_reduce(unit, op=dist.ReduceOp.MIN)
    stretches = []
    for k in stretch_repeats(unit.item()):
        def stretch(k=k):
            for _ in range(k):
                gemm()
        stretches.append(stretch)
    points = []
    for _ in range(rounds):
        for kind, numel in WAIT_CALLS:
            collective = collective_call(kind, torch.ones(numel, device=device), group, size)
            alone = time_call(collective, repeats, warmup, device, calls)
            for call in stretches:
                seconds = time_call(call, repeats, warmup, device, calls)

                def pair(call=call, collective=collective):
                    call()
                    collective()
                both = time_call(pair, repeats, warmup, device, calls)
                points.append((seconds, max(0.0, both - seconds - alone)))
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
