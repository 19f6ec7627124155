"""The C allocator's settings for training on CPU (glibc's malloc, where torch's CPU tensors live).

glibc gives each allocation above its mmap threshold (dynamic, from 128 KiB) fresh pages from
the kernel, and hands freed memory at the top of the heap back above its trim threshold, so a
step that allocates and frees the same large tensors every iteration pays the page faults of
first touch each time. The grouped expert GEMMs (moe/grouped_experts.py) allocate a few such
tensors per layer (8 MiB at 64 experts x 128 rows x 256 wide), and the faults cost as much
as the GEMMs they save. Kept in the process instead, they are reused from the heap:

    tune()   # once, before training starts; a no-op where CUDA runs or the C library is not glibc

the same in every row of a benchmark, Parm's and the peers' (they share the process). Memory
freed stays in the process (up to TRIM), so the resident set reported as the peak can be
larger than the bytes live at once; torch's own CPU allocator advice (jemalloc, tcmalloc)
trades the same way.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP = 32 << 20  # glibc's largest mmap threshold on 64-bit machines
TRIM = 1 << 30
_TUNED: list[bool] = []


def tune() -> bool:
    """Raise glibc's mmap and trim thresholds (once); True where they were set."""
    if _TUNED or torch.cuda.is_available():
        return bool(_TUNED and _TUNED[0])
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        _TUNED.append(False)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP) and mallopt(M_TRIM_THRESHOLD, TRIM))
    _TUNED.append(done)
    return done
