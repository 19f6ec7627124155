"""Peak memory per rank, for the training log: CUDA's peak allocated bytes, else the process's
peak resident set (CPU runs, where tensors live in the process's own memory).

    peak_mib()          # collective: the max over ranks, in MiB
    peak_mib(before)    # and the most any rank added to `before` (its peak before the model)
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


def peak_mib(before: int | None = None):
    """This run's peak so far, max over all ranks (every rank calls it); with `before` (this
    rank's local_peak_bytes() before the model was built), (peak, the most a rank grew since)."""
    device = rank_device()
    now = float(local_peak_bytes())
    peaks = torch.tensor([now, now - (before or 0)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    peak, grown = (value / 2**20 for value in peaks.tolist())
    return peak if before is None else (peak, grown)
