"""--manual-gc: Python's garbage collector run at iteration boundaries only.

The automatic collector starts when allocation counts cross a threshold, at a different moment
on each rank; a collective then waits for the slowest rank's pause. Megatron-LM's --manual-gc
turns it off and collects every --manual-gc-interval iterations (and, unless
--no-manual-gc-eval, before and after each evaluation) on every rank at once.
"""

from __future__ import annotations

import contextlib
import gc


def start(args) -> None:
    if args.manual_gc:
        gc.disable()
        gc.collect()


def after_iteration(args, iteration: int) -> None:
    if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
        gc.collect()


@contextlib.contextmanager
def around_evaluation(args):
    collect = args.manual_gc and args.manual_gc_eval
    if collect:
        gc.collect()
    try:
        yield
    finally:
        if collect:
            gc.collect(generation=0)  # as Megatron-LM: the young objects evaluation made


def end(args) -> None:
    if args.manual_gc:
        gc.enable()
