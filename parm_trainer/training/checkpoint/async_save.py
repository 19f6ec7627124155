"""The processes that write a checkpoint, and --async-save (Megatron-LM's flag).

    torchrun ... pretrain_gpt_moe.py --save DIR --save-interval 5 --async-save

megatron-core's torch_dist writer forks one process per file it writes and reports through a
results queue. With --async-save the write itself runs in a process forked from the rank
(megatron-core's TemporalAsyncCaller, through its AsyncCallsQueue, as Megatron-LM): on CPU the
fork's copy-on-write memory holds the tensors as they were, on GPU megatron copies them to
the host first. Training goes on; after every iteration BackgroundSaves.poll asks every rank
(one all-reduce, only while a save is out) whether all have finished writing, and once they
have, finalises the save exactly as a synchronous one: every rank's verdict, the rename of the
temporary directory, the tracker (save.py). wait() forces that before the next save,
at the end of training and before an error exit that every rank takes (a NaN loss).

Every forked writer dies with the rank that started it (PR_SET_PDEATHSIG), so a rank killed
mid-save leaves no process that writes on into the directory the restarted job saves to.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from typing import Callable, Optional


def results_queue_without_spawn() -> None:
    """megatron-core's writer reports through a queue of a *spawned* multiprocessing manager
    (dist_checkpointing/strategies/filesystem_async.py, _get_write_results_queue), made on a
    process's first save: the spawned process imports the entry script's modules again, which
    cost 4-10 s per rank on CPU. A forked manager, started in milliseconds, serves as well: the
    queue is filled by this process (a synchronous save) or by its forked writer (--async-save)
    and read here. The manager dies with this process, also when this one is killed (else an
    orphan would live on, holding the launcher's output pipe)."""
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()


def die_with_parent(parent: Optional[int] = None) -> None:
    """Linux: ask the kernel to SIGKILL this (forked) process when its parent dies; if the
    parent (pid `parent`) is already gone, exit now."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _dying_with(rank_pid: int, write: Callable) -> Callable:
    """write, to run in the process forked from the rank: it and the per-file writers it forks
    (FileSystemWriterAsync.write_preloaded_data, patched in that process only) die with their
    parents."""
    def run(*args, **kwargs):
        from megatron.core.dist_checkpointing.strategies.filesystem_async import (
            FileSystemWriterAsync)

        die_with_parent(rank_pid)
        writer_parent, write_file = os.getpid(), FileSystemWriterAsync.write_preloaded_data

        def write_file_dying(*a, **k):
            die_with_parent(writer_parent)
            return write_file(*a, **k)

        FileSystemWriterAsync.write_preloaded_data = staticmethod(write_file_dying)
        write(*args, **kwargs)
    return run


class BackgroundSaves:
    """At most one save out at a time; report(path, seconds, held, iteration) is called on
    every rank when one is finalised (seconds since it started, held: how long training
    waited for it, the start and the finalisation included)."""

    def __init__(self, report: Callable, note: Callable = lambda text: None):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.calls = AsyncCallsQueue(persistent=False)  # fork per save: TemporalAsyncCaller
        self.report, self.note = report, note
        self.out = None  # (path, iteration saved, started, seconds held)

    def start(self, request, finish: Callable, path: str, iteration: int, started: float):
        """Fork request's write; finish(megatron's finalize functions) finalises it later."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        assert self.out is None, "wait() for the save out before starting another"
        write = (_dying_with(os.getpid(), request.async_fn) if request.async_fn is not None
                 else None)
        self.calls.schedule_async_request(AsyncRequest(
            write, request.async_fn_args, [lambda: finish(request.finalize_fns)],
            request.async_fn_kwargs, request.preload_fn))
        self.out = (path, iteration, started, time.perf_counter() - started)

    def poll(self, iteration: int) -> None:
        """Finalise the save out if every rank has written its part (a collective)."""
        self._finalize(iteration, blocking=False)

    def wait(self, iteration: int, why: str = "") -> None:
        """Finalise the save out, waiting for the writers (a collective)."""
        if self.out is not None and why:
            self.note(f"waiting for the save of iteration {self.out[1]} to be written "
                      f"{why}")
        self._finalize(iteration, blocking=True)

    def _finalize(self, iteration: int, blocking: bool) -> None:
        if self.out is None:
            return
        began = time.perf_counter()
        path, saved_at, started, held = self.out
        try:
            finished = self.calls.maybe_finalize_async_calls(blocking=blocking)
        except BaseException:
            self.out = None  # the save failed on every rank (CheckpointError) or a rank died
            raise
        now = time.perf_counter()
        self.out = (path, saved_at, started, held + now - began)
        if finished:
            self.out = None
            self.report(path, now - started, held + now - began, iteration)

