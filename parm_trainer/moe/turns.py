"""Micro-batches taking turns on one rank, so that one computes while another's exchange travels.

    turns = Turns()
    turns.run([lambda: step(0), lambda: step(1)])   # each on a thread of its own, one at a time
    pass_turn()        # inside a step: hand over to the next, return when handed back

Exactly one of the threads runs at any time; the others sleep until handed the turn, so the
micro-batches never compute at once and every rank issues its collectives in one same order
(the hand-overs happen at the same points of the program on every rank: a turn is passed
unconditionally, never depending on whether a collective has finished). A thread passes the
turn where it would otherwise wait on the expert-parallel exchange's AlltoAll (step_timing.wait
with hand_over, from comm.py): while those bytes cross the nodes, the next micro-batch computes.
The short waits (the counts, the ESP and MP collectives inside a node) are waited in place, so
that a micro-batch issues its AlltoAll before it hands over. Outside Turns.run, pass_turn()
does nothing.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

_LOCAL = threading.local()  # .turns: (Turns, index) on a thread that Turns.run started


class Turns:
    """`width` worker threads, started once and kept (threads started anew for every pair
    left the process 700 MB more resident: their thread-local pools and malloc arenas)."""

    def __init__(self, width: int = 2):
        self.width = width
        self._cond = threading.Condition()
        self._turn = 0
        self._live: list = []
        self._jobs = [queue.SimpleQueue() for _ in range(width)]
        self._ended = queue.SimpleQueue()
        self._threads: list = []
        self._on_leave = self._on_back = _nothing

    def _hand_over(self, me: int) -> None:
        """Give the turn to the next live thread after `me` (round robin); caller holds _cond."""
        later = [i for i in self._live if i > me] or [i for i in self._live if i != me]
        if later:
            self._turn = later[0]
            self._cond.notify_all()

    def pass_turn(self, me: int) -> float:
        with self._cond:
            if len(self._live) < 2:
                return 0.0
            self._on_leave()
            left = time.perf_counter()
            self._hand_over(me)
            self._cond.wait_for(lambda: self._turn == me)
            away = time.perf_counter() - left
        self._on_back()
        return away

    def _work(self, index: int) -> None:
        _LOCAL.turns = (self, index)
        while True:
            step, threads_per_op = self._jobs[index].get()
            torch.set_num_threads(threads_per_op)
            with self._cond:
                self._cond.wait_for(lambda: self._turn == index)
            error = None
            try:
                step()
            except BaseException as caught:  # noqa: BLE001 - re-raised by run()
                error = caught
            with self._cond:
                self._hand_over(index)
                self._live.remove(index)
            self._ended.put((index, error))

    def run(self, steps: list, on_leave=None, on_back=None) -> None:
        """Run each callable (at most `width`) on a worker thread, taking turns, the first one
        first, until every one has ended; then raise the first exception one raised (in turn
        order), if any. on_leave / on_back: called on a thread as it
        hands the turn over and as it gets it back."""
        if len(steps) > self.width:
            raise ValueError(f"{len(steps)} steps for {self.width} threads")
        while len(self._threads) < self.width:
            thread = threading.Thread(target=self._work, args=(len(self._threads),),
                                      daemon=True, name=f"micro-batch-{len(self._threads)}")
            thread.start()
            self._threads.append(thread)
        with self._cond:
            self._turn, self._live = 0, list(range(len(steps)))
            self._on_leave, self._on_back = on_leave or _nothing, on_back or _nothing
        for index, step in enumerate(steps):
            self._jobs[index].put((step, torch.get_num_threads()))
        errors = [None] * len(steps)
        for _ in steps:
            index, errors[index] = self._ended.get()
        for error in errors:
            if error is not None:
                raise error


def _nothing() -> None:
    pass


def pass_turn() -> float:
    """Hand the turn to the next micro-batch and wait to get it back (a no-op outside
    Turns.run, or where the other micro-batches have ended); the seconds it was away."""
    turns = getattr(_LOCAL, "turns", None)
    return 0.0 if turns is None else turns[0].pass_turn(turns[1])
