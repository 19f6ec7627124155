"""Where transfers share a node's network link, and ranks share a machine's cores.

Links. A ring collective (AllGather, ReduceScatter, AllReduce: gloo and NCCL run them as rings
in the group's rank order; a P2P transfer is a ring of two) sends, from each node, one flow per
ring edge that leaves the node. The groups of one kind in a layout run at once (the DP groups
of every MP rank, the P2P pairs of every stage position), so one node's link carries the flows
of all of them. A node has `links` flows' worth of network at full rate (a NIC per GPU on most
GPU clusters; one shaped link per emulated node): f flows take max(1, f / links) times the
time of one. calibrate_comm measures its "inter" rates with some flows per node (the world
ring: 1; --group-size groups across nodes: one per rank of the node) and the AllReduce again
with the other count; from the two it finds `links`, and Profile.rate scales the calibrated
beta from the calibration's flows to a group's.

Cores. Where ranks share a machine's cores (emulated nodes on one host; a CPU cluster), a
rank computes faster while fewer ranks compute: in a pipeline's warm-up and cool-down most
stages wait. calibrate_comm times the same GEMMs with 1, 2, 4, ... ranks computing at once
and records each time over the all-at-once one (Profile.compute_concurrency); on GPUs the
factors are 1.
"""

from __future__ import annotations

import math


def tiled_groups(size: int, stride: int, per_node: int) -> list:
    """The groups of `size` ranks at `stride` that tile blocks of size x stride consecutive
    ranks, over one period of the placement (lcm of the block and a node)."""
    block = size * stride
    return [[first + i * stride for i in range(size)]
            for start in range(0, math.lcm(block, per_node), block)
            for first in range(start, start + stride)]


def remote_share_of(groups: list, per_node: int) -> float:
    """The largest share of a member's peers that sit on other nodes, over groups: 0 when
    every group is inside a node, 1 when no two members share one."""
    worst = 0.0
    for group in groups:
        if len(group) < 2:
            continue
        nodes = [r // per_node for r in group]
        worst = max(worst, max(sum(n != m for m in nodes) for n in nodes) / (len(group) - 1))
    return worst


def link_flows(groups: list, per_node: int) -> int:
    """The most flows leaving one node when the groups run at once, each a ring in its
    order (member i sends to member i + 1)."""
    out = {}
    for group in groups:
        if len(group) < 2:
            continue
        for i, rank in enumerate(group):
            peer = group[(i + 1) % len(group)]
            if rank // per_node != peer // per_node:
                out[rank // per_node] = out.get(rank // per_node, 0) + 1
    return max(out.values(), default=0)


def sharing(flows: int, links: float) -> float:
    """How many times one flow's time `flows` flows take through `links` links' worth."""
    return max(1.0, flows / links)


def links_from(flows_low: int, beta_low: float, flows_high: int, beta_high: float) -> float:
    """A node's links from AllReduce betas measured with flows_low = 1 and flows_high flows
    per node: the slowdown beta_high / beta_low = max(1, flows_high / links)."""
    slowdown = beta_high / beta_low
    return min(float(flows_high), max(1.0, flows_high / max(slowdown, 1e-9)))


def concurrency_factor(points: tuple, ranks: float) -> float:
    """The compute time factor with `ranks` computing at once, linear between the measured
    (ranks, factor) points and flat beyond them; 1 without points."""
    if not points:
        return 1.0
    points = sorted(points)
    if ranks <= points[0][0]:
        return points[0][1]
    for (r0, f0), (r1, f1) in zip(points, points[1:]):
        if ranks <= r1:
            return f0 + (f1 - f0) * (ranks - r0) / (r1 - r0)
    return points[-1][1]
