"""A load: strict (every rank checks the checkpoint's tensor names and shapes against the
model's before anything is read, and all raise the same error naming the first mismatch),
under any layout; with --ckpt-fallback a latest checkpoint that cannot be read gives way to
the newest one that can."""

from __future__ import annotations

import os
import re
from typing import Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from parm_trainer.models.init import sharded_pieces
from parm_trainer.training.checkpoint.files import (TRACKER, CheckpointError, iteration_dir,
                                                    iterations, read_tracker, strays)
from parm_trainer.training.checkpoint.optimizer_state import (is_distributed, set_adam_state,
                                                              step_kept_apart,
                                                              with_common_steps)
from parm_trainer.training.checkpoint.state import (describe_error, layout, restore_rng,
                                                    scheduler_in_samples, sharded_state)


# keys of optimizer state and RNG streams; every other tensor key belongs to the model
_NOT_MODEL = re.compile(r"^(chained_\d+\.)?optimizer\.|^rng_state")


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


def what_to_load(common: dict, path: str, optimizer, load_optimizer: bool, load_rng: bool):
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
                                   f"({describe_error(error)})") from error
    load_optimizer, with_rng, notes = what_to_load(common, path, optimizer, load_optimizer,
                                                    load_rng)
    metadata = _content_metadata(common)
    step = int(common.get("adam_step", 0))
    if load_optimizer:
        set_adam_state(optimizer, step, placeholders=True)
    template = sharded_state(model, optimizer, scheduler, {},
                              metadata if load_optimizer else None, is_loading=True,
                              with_rng=with_rng)
    try:
        problem = _misfit(template, path)
    except (Exception, CheckpointException) as error:
        raise UnreadableCheckpoint(f"--load {path}: cannot read checkpoint "
                                   f"({describe_error(error)})") from error
    if problem:
        raise CheckpointError(f"--load {path} does not fit this model: {problem}")
    try:
        loaded = dist_checkpointing.load(template, path)
    except (Exception, CheckpointException) as error:  # many kinds; one clear message
        raise UnreadableCheckpoint(f"--load {path}: cannot read checkpoint "
                                   f"({describe_error(error)})") from error
    for index, chunk in enumerate(model):
        unwrapped = getattr(chunk, "module", chunk)  # DDP wraps the megatron module
        unwrapped.load_state_dict(loaded["model" if len(model) == 1 else f"model{index}"])
    if load_optimizer:
        # In fp32 the distributed optimizer's main params are views of the model's leaf params;
        # its in-place copies need no_grad (with bf16 they are separate fp32 tensors).
        saved = loaded["optimizer"]
        if not is_distributed(optimizer):
            saved = with_common_steps(saved, step)
        with torch.no_grad(), step_kept_apart(optimizer):
            optimizer.load_state_dict(saved)
        set_adam_state(optimizer, step, placeholders=False)
        scheduler.load_state_dict(scheduler_in_samples(loaded["opt_param_scheduler"], common))
    if with_rng:
        restore_rng(loaded["rng_state"])
    return int(common["iteration"]), int(common["consumed_train_samples"]), notes
