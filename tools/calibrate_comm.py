"""python tools/calibrate_comm.py --nproc 4 [--sizes 262144,1048576,...] [--repeats 5] [--gpus-per-node N] --output profile.json

Measures the alpha (s) and beta (s/byte) of each collective the MoE cost model prices
(parm_trainer/moe/cost_model.py: "alltoall", "allgather", "reducescatter", "allreduce") on real
process groups, and writes a cost Profile JSON that Profile.from_json loads (pass it with
--moe-parm-cost-profile).

With --nproc N the tool starts N ranks itself on this machine (torch.distributed.run, gloo on
CPU, nccl on GPU); without it, it is one rank of a job started by torchrun (so a multi-node
launch measures the inter-node links):
    torchrun --nnodes 2 --nproc-per-node 8 ... tools/calibrate_comm.py --output profile.json

Groups. The whole world is measured; it is "inter" when --gpus-per-node (default: torchrun's
LOCAL_WORLD_SIZE, the ranks on this node) is smaller than the world, else "intra". When it is
smaller, every node's ranks also form a group (all measured at once), which gives "intra". A link
class with no measurement of its own gets the other's values, and the JSON "description" says so
(a one-machine run measures only "intra", and writes it to "inter" too). For "inter" across real
(or emulated) nodes the table also gives the rate through one node's network link: the fitted
per-rank bandwidth times the node's ranks sending at once times the share of their peers on
other nodes (the groups of --group-size 2 on 2 nodes: 2 ranks per node, all peers remote).
Under tools/emulated_cluster.py this is the number to hold against the shaped rate.

Sizes (--sizes, bytes of the tensor each rank passes in, float32; default 7 sizes from 256 KiB to
16 MiB, large enough that the bandwidth term stands out of scheduling noise; on 4 gloo ranks on 2
cores smaller messages all take ~1-5 ms whatever their size and fit with r^2 < 0.5): the input B of AlltoAll / ReduceScatter / AllReduce and the output of AllGather (whose local
piece is B/W). Each timed sample is --calls back-to-back calls (their mean), which averages out
the scheduling jitter of a single call on an oversubscribed CPU.
For each kind and size: --warmup untimed calls, then --repeats timed calls, each after a barrier
on the group; a call's time is the maximum over the group's ranks (all_reduce MAX), and a size's
time is the median over the repeats. alpha and beta are fitted by least squares
(cost_model.fit_alpha_beta) against the bytes each rank SENDS (comm.py's formulas, which the cost
model prices): AlltoAll and ReduceScatter B(W-1)/W, AllGather (W-1)*piece, AllReduce
2B(W-1)/W. A fit whose alpha or beta comes out <= 0 (noise on a loaded machine; or a shaped link,
whose token bucket lets the first bytes of a call through at once) is redone as least squares
under alpha, beta >= 0, which puts the negative term at its floor (alpha 1 ns, beta refitted
through the origin; or beta 1e-15 s/byte, alpha the mean time), and is flagged "clamped", in
the table and the JSON.
The JSON's extra "fit" key holds, per kind and link, alpha_us, GBps, r2, the group size, whether
it was measured or copied, and the (sent bytes, seconds) points; from_json ignores it.

A fit with r^2 < 0.95 is warned about, or, with --require-r2, ends the run with exit status 1.
Compute and memory: GEMMs of expert-like shapes (GEMM_SHAPES) and row permutations and GELUs
(MEMORY_SHAPES), run on every rank at once (ranks share the node's cores, as they do in a
layer), fitted the same way against their FLOPs into the "compute" entry (alpha s, beta s/FLOP)
and against the bytes they read and write into the "memory" entry (alpha s, beta s/byte). The profile
records the world size it was measured on; --moe-parm-cost-profile refuses it for another.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parm_trainer.moe.cost_model import (KINDS, LINKS, Profile, fit_alpha_beta,  # noqa: E402
                                         sent_bytes)
from parm_trainer.progress import Progress  # noqa: E402

R2_MIN = 0.95
ALPHA_FLOOR = 1e-9   # s
BETA_FLOOR = 1e-15   # s/byte (1 PB/s)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many ranks on this machine under torch.distributed.run")
    p.add_argument("--sizes", type=str, default=None,
                   help="comma-separated bytes per rank (default: 7 sizes, 256 KiB to 16 MiB)")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per size (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per size first")
    p.add_argument("--calls", type=int, default=4,
                   help="back-to-back calls per timed sample (its time is their mean)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="ranks per node (default: LOCAL_WORLD_SIZE, i.e. this node's ranks)")
    p.add_argument("--group-size", type=int, default=None,
                   help="measure groups of this many ranks, all at once, as a layout's MP, EP "
                        "and ESP groups place them (default: the world, and each node)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl when CUDA is available, else gloo")
    p.add_argument("--output", type=str, required=True, help="profile JSON to write")
    p.add_argument("--name", type=str, default="calibrated")
    p.add_argument("--require-r2", action="store_true",
                   help=f"exit 1 if any fit has r^2 < {R2_MIN} (default: warn)")
    p.add_argument("--timeout-minutes", type=float, default=10.0)
    args = p.parse_args(argv)
    if args.group_size is not None and args.group_size < 2:
        p.error("--group-size must be at least 2")
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if args.sizes:
        args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    else:
        args.sizes = [int(s) for s in np.geomspace(256 << 10, 16 << 20, 7)]
    if len(args.sizes) < 2 or min(args.sizes) <= 0:
        p.error("--sizes needs at least two positive sizes")
    return args


# --- launcher ------------------------------------------------------------------------------

def launch(argv, nproc: int) -> int:
    """Re-run this tool as `nproc` ranks under torchrun on this machine."""
    from parm_trainer.launch import relaunch

    return relaunch(__file__, argv, nproc)


# --- the worker ----------------------------------------------------------------------------

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


def worker(args) -> int:
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if "RANK" not in os.environ:  # a plain `python` run: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29518"))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=args.timeout_minutes))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        if rank == 0:
            print("calibrate_comm: needs at least 2 ranks (use --nproc N or torchrun)",
                  file=sys.stderr)
        dist.destroy_process_group()
        return 2
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    per_node = args.gpus_per_node or local
    hosts = world // local if world % local == 0 else None

    measured, shares = {}, {}  # link -> (group size, {kind: points}); link -> node_share
    remote = {}  # link -> remote_peers
    links = calibration_groups(world, per_node, args.group_size)
    progress = Progress(len(links) + 2, "calibrate_comm", enabled=rank == 0)
    for link, groups in links.items():
        measured[link] = measure_groups(groups, args, device)
        shares[link], remote[link] = node_share(groups, per_node), remote_peers(groups, per_node)
        progress.done(f"{link} collectives ({len(groups)} group(s) of {len(groups[0])})")
    local = {}
    for name, cases in (("compute", gemm_cases), ("memory", memory_cases)):
        local[name] = measure_local(cases(device), args.repeats, args.warmup, device, args.calls)
        progress.done(f"{name} rate")
    status = 0
    if rank == 0:
        status = report(args, backend, world, per_node, hosts, measured, local, shares, remote)
    dist.barrier()
    dist.destroy_process_group()
    return status


def report(args, backend, world, per_node, hosts, measured, local, shares, remote) -> int:
    fits = {link: {k: fit(points) for k, points in pts.items()}
            for link, (_, pts) in measured.items()}
    notes = [f"measured by tools/calibrate_comm.py: {backend}, world {world}, "
             f"{per_node} ranks per node" + (f" ({hosts} host(s) by LOCAL_WORLD_SIZE)"
                                             if hosts else ""),
             f"sizes {args.sizes} bytes per rank, median of {args.repeats} after "
             f"{args.warmup} warm-up; compute and memory fitted on GEMMs and on row "
             "permutations and GELUs run on every rank at once"]
    for link in LINKS:
        if link not in fits:
            other = "intra" if link == "inter" else "inter"
            notes.append(f"'{link}' not measured (no {'multi-node' if link == 'inter' else 'intra-node'}"
                         f" group): copied from '{other}'")
    if hosts == 1 and "inter" in measured:
        notes.append(f"one host: 'inter' groups (--gpus-per-node {per_node}) did not cross a "
                     "network")

    collectives, extra, bad = {}, {}, []
    for kind in KINDS:
        collectives[kind], extra[kind] = {}, {}
        for link in LINKS:
            src = link if link in fits else ("intra" if link == "inter" else "inter")
            alpha, beta, r2, clamped = fits[src][kind]
            # the model prices an inter-node AlltoAll per byte that crosses (Profile.price):
            # where some measured peers shared a node, the fitted beta per byte sent is more
            share = remote[src] if kind == "alltoall" and link == src == "inter" else 1.0
            collectives[kind][link] = (alpha, beta / share)
            extra[kind][link] = {"alpha_us": alpha * 1e6, "GBps": 1.0 / beta / 1e9, "r2": r2,
                                 "node_link_GBps": shares[src] / beta / 1e9 if src == "inter"
                                 and link == "inter" else None,
                                 "clamped": clamped, "measured": src == link,
                                 "group_size": measured[src][0],
                                 "points": [[b, s] for b, s in measured[src][1][kind]]}
    local_fits = {name: fit(points) for name, points in local.items()}
    # gloo gives each process group two worker threads (ProcessGroupGloo's default), so two
    # started collectives of one group run at once; NCCL runs them in order on its stream
    profile = Profile(gpus_per_node=per_node, collectives=collectives,
                      lanes=2 if backend == "gloo" else 1,
                      compute=local_fits["compute"][:2], memory=local_fits["memory"][:2],
                      name=args.name, description="; ".join(notes), world_size=world)
    data = json.loads(profile.to_json())
    for name, (alpha, beta, r2, clamped) in local_fits.items():
        rate = ("TFLOPs", 1e12) if name == "compute" else ("GBps", 1e9)
        extra[name] = {"alpha_us": alpha * 1e6, rate[0]: 1.0 / beta / rate[1], "r2": r2,
                       "clamped": clamped, "points": [list(p) for p in local[name]]}
    data["fit"] = extra
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    with open(args.output, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")

    print(f"{'kind':<14}{'link':<7}{'ranks':>6}{'alpha (us)':>12}{'GB/s':>12}{'r^2':>8}"
          f"{'node link GB/s':>16}")
    for link in LINKS:
        if link not in fits:
            continue
        for kind in KINDS:
            alpha, beta, r2, clamped = fits[link][kind]
            flag = " clamped" if clamped else ""
            node = (f"{shares[link] / beta / 1e9:>16.4g}" if link == "inter" and hosts
                    and hosts > 1 else f"{'-':>16}")
            print(f"{kind:<14}{link:<7}{measured[link][0]:>6}{alpha * 1e6:>12.2f}"
                  f"{1.0 / beta / 1e9:>12.4g}{r2:>8.3f}{node}{flag}")
            if r2 < R2_MIN:
                bad.append(f"{kind}/{link} r^2={r2:.3f}")
    for name, (alpha, beta, r2, clamped) in local_fits.items():
        flag = " clamped" if clamped else ""
        unit = "TFLOP/s" if name == "compute" else "GB/s moved"
        rate = 1.0 / beta / (1e12 if name == "compute" else 1e9)
        print(f"{name:<14}{'-':<7}{world:>6}{alpha * 1e6:>12.2f}{rate:>12.4g}{r2:>8.3f}{flag}"
              f"   ({unit})")
        if r2 < R2_MIN:
            bad.append(f"{name} r^2={r2:.3f}")
    for note in notes[2:]:
        print(f"note: {note}")
    print(f"wrote {args.output}")
    if bad:
        message = f"calibrate_comm: fit r^2 below {R2_MIN}: {', '.join(bad)}"
        if args.require_r2:
            print(message, file=sys.stderr)
            return 1
        print(f"warning: {message[len('calibrate_comm: '):]} (more --repeats or a wider "
              "--sizes range may help)", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.nproc is not None:
        if args.nproc < 2:
            print("calibrate_comm: --nproc must be at least 2", file=sys.stderr)
            return 2
        return launch(argv, args.nproc)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
