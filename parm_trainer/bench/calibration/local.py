"""The rates of one rank's own work: the expert MLP's GEMMs, the memory rate of token
permutation, and compute with fewer ranks at once (shared cores)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parm_trainer.bench.calibration.collectives import time_call


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
