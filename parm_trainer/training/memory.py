"""Peak memory per rank, for the training log: CUDA's peak allocated bytes, else the process's
peak resident set (CPU runs, where tensors live in the process's own memory).

    peak_mib()   # collective: the max over ranks, in MiB
"""

from __future__ import annotations

import resource
import sys

import torch

from parm_trainer.parallel import rank_device

KIND = "allocated" if torch.cuda.is_available() else "rss"


def local_peak_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def peak_mib() -> float:
    """This run's peak so far, max over all ranks (every rank calls it)."""
    device = rank_device()
    peak = torch.tensor([float(local_peak_bytes())], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return peak.item() / 2**20
