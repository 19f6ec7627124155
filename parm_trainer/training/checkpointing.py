"""Save and resume with megatron-core's dist_checkpointing, never leaving a half checkpoint.

The files on disk (Megatron-LM's layout, plus run.json and a tokenizer copy) are described in
checkpoint_files.py.

Every tensor is saved in its layout-free global shape (the model's by megatron-core; the
distributed optimizer's in megatron-core's `fully_reshardable` format, one state tensor per
parameter), so a checkpoint loads under any TP/EP/ESP/PP/DP. Loading is strict: before
anything is read, every rank checks the checkpoint's tensor names and shapes against the model's,
and all ranks raise the same error naming the first mismatch.

A save is written to `iter_XXXXXXX.tmp`, and only once every rank has finished is it renamed
and the tracker file replaced (os.replace is atomic). A crash mid-save leaves the previous
checkpoint marked latest and a stray .tmp directory (or a directory newer than the tracker)
that the next start names and the next save removes; a save that fails on any rank (a full
disk) fails on every rank with one line and leaves the previous checkpoint as it was. With
--ckpt-fallback a latest checkpoint that cannot be read gives way to the newest one that can.
With --async-save the shards are written in the background (async_save.py) and the same
verdict, rename and tracker follow at a later iteration, once every rank has written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import Optional

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.tensor_parallel import random as mrandom
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

import parm_trainer
from parm_trainer import parallel
from parm_trainer.models.init import sharded_pieces
from parm_trainer.training import async_save, faults, watchdog
from parm_trainer.training.optimizer_state import (adam_step, is_distributed, set_adam_state,
                                                   step_for_empty_optimizers, step_kept_apart)
from parm_trainer.training.checkpoint_files import (DESCRIPTION, TOKENIZER, TRACKER,  # noqa: F401
                                                   CheckpointError, iteration_dir, iterations,
                                                   read_description, read_tracker,
                                                   replace_tracker, strays)

# keys of optimizer state and RNG streams; every other tensor key belongs to the model
_NOT_MODEL = re.compile(r"^(chained_\d+\.)?optimizer\.|^rng_state")


def layout() -> dict:
    """This run's parallel layout, as the checkpoint records it."""
    ps = parallel_state
    sizes = {"tp": ps.get_tensor_model_parallel_world_size(),
             "pp": ps.get_pipeline_model_parallel_world_size(),
             "dp": ps.get_data_parallel_world_size(),
             "ep": ps.get_expert_model_parallel_world_size(),
             "esp": ps.get_expert_tensor_parallel_world_size(),
             "world": torch.distributed.get_world_size()}
    stages = parallel.recorded_pipeline_stages()  # None for megatron's even split
    return {**sizes, "stages": stages} if stages else sizes


def _rng_state() -> ShardedObject:
    """This rank's CPU/CUDA/tracker RNG states, gathered over data parallel (as Megatron-LM)."""
    state = {"cpu": torch.get_rng_state(),
             "tracker": mrandom.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    dp_group = parallel_state.get_data_parallel_group()
    gathered = [None] * torch.distributed.get_world_size(dp_group)
    torch.distributed.all_gather_object(gathered, state, group=dp_group)
    pp, tp = (parallel_state.get_pipeline_model_parallel_world_size(),
              parallel_state.get_tensor_model_parallel_world_size())
    return ShardedObject("rng_state", gathered, (pp, tp),
                         (parallel_state.get_pipeline_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank())


def _restore_rng(gathered: list) -> None:
    state = gathered[parallel_state.get_data_parallel_rank()]
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    mrandom.get_cuda_rng_tracker().set_states(state["tracker"])


def _optimizer_metadata(fully_reshardable: bool, mem_efficient: bool = False) -> dict:
    return {"distrib_optim_sharding_type":
            "fully_reshardable" if fully_reshardable else "dp_reshardable",
            "distrib_optim_fully_reshardable_mem_efficient": mem_efficient}


def _sharded_state(model, optimizer, scheduler, extra: dict, optimizer_metadata: Optional[dict],
                   is_loading: bool, with_rng: bool = True) -> dict:
    """What dist_checkpointing saves or loads; optimizer_metadata None leaves the optimizer out."""
    state = dict(extra)
    model_state = {}
    for index, chunk in enumerate(model):
        key = "model" if len(model) == 1 else f"model{index}"
        state[key] = getattr(chunk, "module", chunk).sharded_state_dict()  # without DDP's prefix
        model_state[key] = state[key]  # nested: chunks share their local names
    if optimizer_metadata is not None:
        with step_for_empty_optimizers(optimizer):
            state["optimizer"] = optimizer.sharded_state_dict(
                model_state, is_loading=is_loading, metadata=optimizer_metadata)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_state()
    return state


def _json_safe(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)  # torch dtypes and the like


def describe_run(args, iteration: int) -> dict:
    """The run.json of a checkpoint: enough for a tool to rebuild the model from the directory."""
    return {"format": "parm_trainer checkpoint", "version": parm_trainer.__version__,
            "model": getattr(args, "model_family", "gpt"),
            "iteration": iteration, "layout": layout(),
            "args": {k: _json_safe(v) for k, v in sorted(vars(args).items())}}


def _write_description(args, iteration: int, directory: str) -> None:
    with open(os.path.join(directory, DESCRIPTION), "w") as f:
        json.dump(describe_run(args, iteration), f, indent=1)
    tokenizer = getattr(args, "tokenizer_model", None)
    if tokenizer and os.path.isfile(tokenizer):
        shutil.copyfile(tokenizer, os.path.join(directory, TOKENIZER))


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler,
                    consumed_train_samples: int, args, background=None) -> tuple:
    """Write SAVE/iter_N whole or not at all; returns (its path, seconds taken).

    optimizer None: the weights alone (the converters' checkpoints), which load as a start
    with a fresh optimizer. background (--async-save, an async_save.BackgroundSaves): the
    previous save is finalised first, this one's shards are written by a forked process while
    training goes on, and background finalises it later as _finish does here; the seconds
    returned are then those training waited."""
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
    whole = optimizer is not None
    extra = {"iteration": iteration, "consumed_train_samples": consumed_train_samples,
             "adam_step": adam_step(optimizer) if whole else 0, "layout": layout(),
             "distributed_optimizer": is_distributed(optimizer), "with_optimizer": whole,
             "with_rng": whole}
    metadata = _optimizer_metadata(args.dist_ckpt_optim_fully_reshardable,
                                   args.distrib_optim_fully_reshardable_mem_efficient)
    state = _sharded_state(model, optimizer, scheduler, extra, metadata if whole else None,
                           is_loading=False, with_rng=whole)
    async_save.results_queue_without_spawn()
    failure, request = None, None
    try:
        request = dist_checkpointing.save(state, tmp, content_metadata=metadata,
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
                _write_description(args, iteration, tmp)  # after: megatron wants an empty dir
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
    verdict = None if failure is None else (torch.distributed.get_rank(), _describe(failure))
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


def _describe(error: BaseException) -> str:
    failures = getattr(error, "failures", None)  # CheckpointException: rank -> exception
    if failures:
        error = next(iter(failures.values()))
        if isinstance(error, tuple):  # (exception, traceback frames)
            error = error[0]
    text = str(error).splitlines()[0][:300] if str(error) else "unreadable or truncated shard"
    return f"{type(error).__name__}: {text}"


def _tensor_shapes(state: dict) -> dict:
    """key -> global shape of every tensor a sharded state dict saves or loads."""
    shapes = {}
    for value in nested_values(state):
        for tensor in sharded_pieces(value):
            shapes[tensor.key] = tuple(tensor.global_shape)
    return shapes


def _misfit(template: dict, path: str) -> Optional[str]:
    """The first tensor where the checkpoint and this model disagree, the same on every rank.

    Every rank compares its part of the model (and optimizer) with the checkpoint's metadata;
    the ranks then share their first problem and their model keys, so a checkpoint tensor that no
    rank's model has (dist_checkpointing's default would ignore it) is found too."""
    saved = {key: tuple(meta.global_shape)
             for key, meta in dist_checkpointing.load_tensors_metadata(path).items()}
    wanted = _tensor_shapes(template)
    problem = None
    for key, shape in wanted.items():
        if key not in saved:
            problem = f"this run's tensor {key} {list(shape)} is not in the checkpoint"
        elif saved[key] != shape:
            problem = (f"tensor {key} has shape {list(saved[key])} in the checkpoint and "
                       f"{list(shape)} in this model")
        if problem:
            break
    model_keys = {key for key in wanted if not _NOT_MODEL.match(key)}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (problem, model_keys))
    problems = [p for p, _ in gathered if p]
    if problems:
        return problems[0]
    every_model_key = set().union(*(keys for _, keys in gathered))
    extra = sorted(k for k in saved if not _NOT_MODEL.match(k) and k not in every_model_key)
    if extra:
        return (f"the checkpoint's tensor {extra[0]} {list(saved[extra[0]])} is not in this "
                f"model ({len(extra)} such)")
    return None


def _layout_text(lay: Optional[dict]) -> str:
    if not lay:
        return "an unrecorded layout"
    return " ".join(f"{k.upper()}{lay[k]}" for k in ("tp", "pp", "dp", "ep", "esp")) + (
        f" stages {lay['stages']}" if "stages" in lay else "")


def _content_metadata(common: dict) -> dict:
    """What save() recorded of the optimizer's format (none in checkpoints before it did)."""
    return dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}


def _what_to_load(common: dict, path: str, optimizer, load_optimizer: bool, load_rng: bool):
    """(load the optimizer?, load the RNG streams?, notes for the log) for this run; raises
    where the optimizer state asked for cannot fit."""
    notes = []
    saved_layout, now = common.get("layout"), layout()
    same_layout = saved_layout == now
    if load_optimizer and not common.get("with_optimizer", True):
        load_optimizer = False
        notes.append("the checkpoint holds weights only: the optimizer starts afresh")
    sharding = _content_metadata(common).get("distrib_optim_sharding_type", "dp_reshardable")
    distributed = is_distributed(optimizer)
    if load_optimizer and common.get("distributed_optimizer", distributed) != distributed:
        was, is_ = ("with", "without") if not distributed else ("without", "with")
        raise CheckpointError(
            f"--load {path}: its optimizer state was saved {was} --use-distributed-optimizer "
            f"and this run is {is_} it; resume {was} it (under any layout), "
            f"or add --no-load-optim")
    if load_optimizer and distributed and not same_layout and sharding == "dp_reshardable":
        raise CheckpointError(
            f"--load {path}: its distributed-optimizer state was saved in megatron-core's "
            f"dp_reshardable format under {_layout_text(saved_layout)}, which loads only under "
            f"that layout (this run: {_layout_text(now)}); resume there, or add --no-load-optim")
    with_rng = load_rng and same_layout and common.get("with_rng", True)
    if load_rng and not with_rng:
        why = (f"the checkpoint was saved under {_layout_text(saved_layout)}, this run is "
               f"{_layout_text(now)}" if not same_layout else "the checkpoint has none")
        notes.append(f"RNG streams not restored: {why}; dropout streams start afresh from "
                     f"--seed")
    return load_optimizer, with_rng, notes


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint directory that is missing, incomplete or corrupt (--ckpt-fallback skips
    it); a checkpoint that reads but does not fit the model is a plain CheckpointError."""


def load_checkpoint(root: str, model, optimizer, scheduler, load_optimizer: bool = True,
                    load_rng: bool = True, fallback: bool = False):
    """Load the latest checkpoint under `root` in place, under any layout; with fallback, if
    the latest cannot be read, the newest older one that can.

    Returns (iteration, consumed samples, notes): notes are lines for the log (what was
    ignored, why the RNG streams were not restored). Raises CheckpointError, identically on
    every rank, when it cannot.
    """
    iteration = read_tracker(root)
    if iteration is None:
        raise CheckpointError(f"--load {root}: no {TRACKER} (no checkpoint was finished there)")
    notes = strays(root)
    candidates = [iteration] + ([it for it in iterations(root) if it < iteration]
                                if fallback else [])
    for candidate in candidates:
        try:
            loaded = _load_dir(iteration_dir(root, candidate), model, optimizer, scheduler,
                               load_optimizer, load_rng)
        except UnreadableCheckpoint as error:
            if candidate == candidates[-1]:
                raise
            notes.append(f"{error}; trying the one before (--ckpt-fallback)")
            continue
        if candidate != iteration:
            notes.append(f"resumed from the newest readable checkpoint, iteration {candidate} "
                         f"(--ckpt-fallback)")
        return loaded[0], loaded[1], notes + loaded[2]


def _load_dir(path: str, model, optimizer, scheduler, load_optimizer: bool, load_rng: bool):
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise UnreadableCheckpoint(f"--load {path} is missing or incomplete (no "
                                   f"{os.path.join(path, 'metadata.json')})")
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except (Exception, CheckpointException) as error:
        raise UnreadableCheckpoint(f"--load {path}: cannot read checkpoint "
                                   f"({_describe(error)})") from error
    load_optimizer, with_rng, notes = _what_to_load(common, path, optimizer, load_optimizer,
                                                    load_rng)
    metadata = _content_metadata(common)
    step = int(common.get("adam_step", 0))
    if load_optimizer:
        set_adam_state(optimizer, step, placeholders=True)
    template = _sharded_state(model, optimizer, scheduler, {},
                              metadata if load_optimizer else None, is_loading=True,
                              with_rng=with_rng)
    try:
        problem = _misfit(template, path)
    except (Exception, CheckpointException) as error:
        raise UnreadableCheckpoint(f"--load {path}: cannot read checkpoint "
                                   f"({_describe(error)})") from error
    if problem:
        raise CheckpointError(f"--load {path} does not fit this model: {problem}")
    try:
        loaded = dist_checkpointing.load(template, path)
    except (Exception, CheckpointException) as error:  # many kinds; one clear message
        raise UnreadableCheckpoint(f"--load {path}: cannot read checkpoint "
                                   f"({_describe(error)})") from error
    for index, chunk in enumerate(model):
        unwrapped = getattr(chunk, "module", chunk)  # DDP wraps the megatron module
        unwrapped.load_state_dict(loaded["model" if len(model) == 1 else f"model{index}"])
    if load_optimizer:
        # In fp32 the distributed optimizer's main params are views of the model's leaf params;
        # its in-place copies need no_grad (with bf16 they are separate fp32 tensors).
        with torch.no_grad(), step_kept_apart(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
        set_adam_state(optimizer, step, placeholders=False)
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if with_rng:
        _restore_rng(loaded["rng_state"])
    return int(common["iteration"]), int(common["consumed_train_samples"]), notes
