"""A process's end without the interpreter's teardown.

A Python that imported torch and megatron-core spends about 1.6 s of CPU at exit freeing its
modules (measured on a 2-core machine; 4 ranks of a node pay it together, 3 s and more of wall
time after the last line of a run). Nothing of the run's depends on that teardown: the entry
points have already closed their process groups, finalised their saves and flushed their
writers. end() does what a normal exit does that matters (joins the threads that are not
daemons, runs the atexit callbacks: wandb's, logging's, multiprocessing's joins of child
processes; flushes stdout and stderr) and then leaves with os._exit.

In a process that multiprocessing forked (a rank of a torchrun whose start method is fork),
the fork's own bootstrap already ends with os._exit and runs no atexit callbacks, and those it
inherited belong to its parent: end() leaves that path alone and only raises SystemExit for a
failing status.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import threading


def end(status: int | None = 0) -> None:
    """Leave the process with `status` (None: 0), as sys.exit(status) would; call it last, from
    a script's __main__ block."""
    status = status or 0
    if multiprocessing.parent_process() is not None:
        if status:
            sys.exit(status)
        return
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    now(status)


def now(status: int) -> None:
    """Leave at once: stdout and stderr flushed, nothing else run (the bench tools' end, with
    megatron's and DeepSpeed's process groups still up: bench/layout.leave)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
