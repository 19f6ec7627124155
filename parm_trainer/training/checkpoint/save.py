"""A save: written to `iter_XXXXXXX.tmp`, renamed and the tracker replaced only once every rank
has written (a save that fails on any rank fails on every rank with one line, and the
previous checkpoint stays latest); with --async-save the shards are written in the background
(async_save.py) and the same verdict follows at a later iteration."""

from __future__ import annotations

import os
import shutil
import time

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from parm_trainer.training import faults, watchdog
import parm_trainer.training.checkpoint.async_save as async_save
from parm_trainer.training.checkpoint.files import CheckpointError, iteration_dir, replace_tracker
from parm_trainer.training.checkpoint.optimizer_state import adam_step, is_distributed
from parm_trainer.training.checkpoint.state import (SCHEDULER_COUNTS, describe_error, layout,
                                                    optimizer_metadata, sharded_state,
                                                    write_description)


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler,
                    consumed_train_samples: int, args, background=None,
                    sharded_strategy=None) -> tuple:
    """Write SAVE/iter_N whole or not at all; returns (its path, seconds taken).

    optimizer None: the weights alone (the converters' checkpoints), which load as a start
    with a fresh optimizer. background (--async-save, an async_save.BackgroundSaves): the
    previous save is finalised first, this one's shards are written by a forked process while
    training goes on, and background finalises it later as _finish does here; the seconds
    returned are then those training waited. sharded_strategy: megatron-core's save strategy
    (None: its default; the converters stream theirs, convert/stream_checkpoint.py)."""
    if background is not None:
        background.wait(iteration, f"before saving iteration {iteration} (a longer "
                                   f"--save-interval leaves it time)")
    start = time.perf_counter()
    watchdog.beat(iteration, "save (writing)")
    rank = torch.distributed.get_rank()
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    torch.distributed.barrier()
    # the optimizer (and LR schedule) and the RNG streams, unless --no-save-optim/--no-save-rng
    with_optimizer = optimizer is not None and not getattr(args, "no_save_optim", False)
    with_rng = optimizer is not None and not getattr(args, "no_save_rng", False)
    extra = {"iteration": iteration, "consumed_train_samples": consumed_train_samples,
             "adam_step": adam_step(optimizer) if with_optimizer else 0, "layout": layout(),
             "distributed_optimizer": is_distributed(optimizer),
             "with_optimizer": with_optimizer, "with_rng": with_rng,
             "scheduler_counts": SCHEDULER_COUNTS}
    metadata = optimizer_metadata(args.dist_ckpt_optim_fully_reshardable,
                                   args.distrib_optim_fully_reshardable_mem_efficient)
    state = sharded_state(model, optimizer, scheduler, extra,
                           metadata if with_optimizer else None, is_loading=False,
                           with_rng=with_rng)
    async_save.results_queue_without_spawn()
    failure, request = None, None
    try:
        request = dist_checkpointing.save(state, tmp, sharded_strategy=sharded_strategy,
                                          content_metadata=metadata,
                                          async_sharded_save=background is not None)
    except (OSError, CheckpointException) as error:
        failure = error
    if background is not None:
        _agree_saved(failure, tmp, final)  # what was written before the fork
        finish = lambda finalize_fns: _finish(root, iteration, args, tmp, final,  # noqa: E731
                                              finalize_fns=finalize_fns)
        background.start(request, finish, final, iteration, start)
        faults.in_save("write", iteration)  # while this rank's writer is at work
        return final, time.perf_counter() - start
    _finish(root, iteration, args, tmp, final, failure)
    return final, time.perf_counter() - start


def _finish(root: str, iteration: int, args, tmp: str, final: str, failure=None,
            finalize_fns=None) -> None:
    """Once every rank has written its shards (or failed: failure): for a background save
    megatron's finalize_fns (gather the ranks' write results, write the metadata; a synchronous
    save() ran them), run.json, every rank's verdict; then rank 0 renames tmp to final and
    moves the tracker."""
    rank = torch.distributed.get_rank()
    watchdog.beat(iteration, "save (waiting for every rank's shards)")
    try:
        for finalize in finalize_fns or ():
            finalize()
        if failure is None:
            if finalize_fns is None:
                faults.in_save("write", iteration)  # a background save's fired at its start
            if rank == 0:
                write_description(args, iteration, tmp)  # after: megatron wants an empty dir
    except (OSError, CheckpointException) as error:
        failure = error
    _agree_saved(failure, tmp, final)
    if rank == 0:
        faults.in_save("rename", iteration)
        _rename_over(tmp, final)
        faults.in_save("renamed", iteration)
        replace_tracker(root, iteration, before_replace=lambda: faults.in_save("tracker",
                                                                               iteration))
    torch.distributed.barrier()


def _agree_saved(failure, tmp: str, final: str) -> None:
    """Every rank learns whether every rank wrote its part; if one did not, all raise the same
    CheckpointError (the first failing rank's reason) and the partial directory goes."""
    verdict = None if failure is None else (torch.distributed.get_rank(), describe_error(failure))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, verdict)
    failed = [entry for entry in gathered if entry is not None]
    if not failed:
        return
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    rank, reason = failed[0]
    free = shutil.disk_usage(os.path.dirname(final)).free / 2**20
    raise CheckpointError(f"cannot save {final} (rank {rank}: {reason}; its disk has "
                          f"{free:.1f} MiB free); the previous checkpoint is kept")


def _rename_over(tmp: str, final: str) -> None:
    """tmp -> final; an existing final (this iteration saved before) is moved aside first and
    removed after: a crash leaves the tracker naming nothing only between the two renames, not
    for as long as removing a whole directory takes."""
    aside = final + ".old"
    shutil.rmtree(aside, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, aside)
    os.rename(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)
