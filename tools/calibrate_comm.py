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
The measurements are parm_trainer/bench/calibration/, the profile and the table
parm_trainer/bench/calibration/report.py.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from parm_trainer.process_exit import end
from parm_trainer.bench.calibration import calibrate
from parm_trainer.bench.calibration.fit import R2_MIN
from parm_trainer.bench.calibration.report import report


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


def _device(backend):
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def worker(args) -> int:
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = _device(backend)
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
    measured, local_points, shares, remote = calibrate(args, device, per_node)
    status = 0
    if rank == 0:
        status = report(args, backend, world, per_node, hosts, measured, local_points, shares,
                        remote)
    dist.barrier()
    dist.destroy_process_group()
    return status


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.nproc is not None:
        if args.nproc < 2:
            print("calibrate_comm: --nproc must be at least 2", file=sys.stderr)
            return 2
        from parm_trainer.launch import relaunch

        return relaunch(__file__, argv, args.nproc)
    return worker(args)


if __name__ == "__main__":
    end(main())
