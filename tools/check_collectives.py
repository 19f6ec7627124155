"""torchrun --nproc-per-node N tools/check_collectives.py

The MoE layer's collectives (parm_trainer/moe/comm.py and comm_uneven.py), forward and
backward, on the job's backend (NCCL with CUDA) against the same calls on a gloo group over
the same ranks on CPU copies of the same tensors, in fp32 and bf16. Moves (AlltoAll, AllGather,
their uneven forms, split and gather) must agree exactly; sums (ReduceScatter, AllReduce and the
backward of the gathers) to 1e-6 relative in fp32 and 1e-2 in bf16 (NCCL may add in another
order). Without CUDA both sides are gloo, which checks the harness itself (gpu_smoke --dry-run).
Prints one line per op and dtype on rank 0; exits 1 if any differs.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from parm_trainer.process_exit import end
from parm_trainer.moe import comm
from parm_trainer.moe import comm_uneven as cu

ROWS, COLS = 6, 5
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def _uneven_counts(world: int, rank: int) -> tuple:
    """Rows rank r sends to rank j: (r + 2 j) % 3 (some zero); the same table on every rank."""
    table = [[(r + 2 * j) % 3 for j in range(world)] for r in range(world)]
    return [table[rank][j] for j in range(world)], [table[j][rank] for j in range(world)]


def ops(world: int, rank: int) -> dict:
    """name -> (fn(x, group), rows of x, exact): each a forward through comm's autograd ops."""
    send, recv = _uneven_counts(world, rank)
    gather_rows = [2 + j % 2 for j in range(world)]  # allgather-v / reducescatter-v rows
    return {
        "alltoall": (lambda x, g: comm.all_to_all(x, g, "t"), ROWS * world, True),
        "allgather": (lambda x, g: comm.all_gather(x, g, "t", dim=1), ROWS, False),
        "reducescatter": (lambda x, g: comm.reduce_scatter(x, g, "t", dim=0), ROWS * world,
                          False),
        "allreduce": (lambda x, g: comm.all_reduce(x, g, "t"), ROWS, False),
        "split+gather": (lambda x, g: comm.gather(comm.split(x, g, "t", 0), g, "t", 0),
                         ROWS * world, True),
        "start/finish alltoall": (
            lambda x, g: comm.finish(comm.start("alltoall", x, g, "t")), ROWS * world, True),
        "alltoall-v": (lambda x, g: cu.run(x, cu.counts_of("alltoall", rank, send=send,
                                                           recv=recv), g, "t"),
                       sum(send), True),
        "allgather-v": (lambda x, g: cu.run(x, cu.counts_of("allgather", rank,
                                                            counts=gather_rows), g, "t"),
                        gather_rows[rank], False),
        "reducescatter-v": (lambda x, g: cu.run(x, cu.counts_of("reducescatter", rank,
                                                                counts=gather_rows), g, "t"),
                            sum(gather_rows), False),
    }


def _run(fn, x, grad_seed, group):
    x = x.clone().requires_grad_()
    out = fn(x, group)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    out.backward(grad.to(out.dtype).to(out.device))
    return out.detach().float().cpu(), x.grad.detach().float().cpu()


def _relative(a, b) -> float:
    scale = max(b.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() / scale if a.numel() else 0.0


def main() -> int:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    main_group, gloo = dist.group.WORLD, dist.new_group(backend="gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    failed = 0
    for dtype, tolerance in TOLERANCE.items():
        for index, (name, (fn, rows, exact)) in enumerate(ops(world, rank).items()):
            gen = torch.Generator().manual_seed(1000 * index + rank)
            x = torch.randn(rows, COLS, generator=gen).to(dtype)
            got = _run(fn, x.to(device), 7 * index + rank, main_group)
            want = _run(fn, x, 7 * index + rank, gloo)
            worst = max(_relative(a, b) for a, b in zip(got, want))
            ok = worst == 0.0 if exact else worst <= tolerance
            verdict = torch.tensor([0 if ok else 1], device=device)
            dist.all_reduce(verdict)  # every rank agrees on the verdict
            failed += int(verdict.item() > 0)
            if rank == 0:
                bound = "exact" if exact else f"<= {tolerance:g}"
                print(f"{'ok  ' if verdict.item() == 0 else 'FAIL'} {name:22s} "
                      f"{str(dtype).replace('torch.', ''):8s} max rel diff {worst:.1e} "
                      f"({bound}; {dist.get_backend()} vs gloo, {world} ranks)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    end(main())
