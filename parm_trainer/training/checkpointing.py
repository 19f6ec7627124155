"""Save and resume with megatron-core's dist_checkpointing, never leaving a half checkpoint.

Layout on disk (Megatron-LM's):
    SAVE/iter_0000200/                    one dist_checkpointing directory per save
    SAVE/latest_checkpointed_iteration.txt

A save is written to `iter_XXXXXXX.tmp`, and only once every rank has finished is it renamed
and the tracker file replaced (os.replace is atomic). A crash mid-save leaves the previous
checkpoint marked latest and a stray .tmp directory that the next save removes.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import random as mrandom
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

TRACKER = "latest_checkpointed_iteration.txt"
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or does not fit the model."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number, found {text!r}")
    return int(text)


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
    dp_rank = parallel_state.get_data_parallel_rank()
    if len(gathered) != parallel_state.get_data_parallel_world_size():
        return  # saved under another data-parallel size: dropout streams cannot carry over
    state = gathered[dp_rank]
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    mrandom.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(model, optimizer, scheduler, extra: dict, with_optimizer: bool,
                   is_loading: bool) -> dict:
    state = dict(extra)
    model_state = {}
    for index, chunk in enumerate(model):
        key = "model" if len(model) == 1 else f"model{index}"
        state[key] = getattr(chunk, "module", chunk).sharded_state_dict()  # without DDP's prefix
        model_state.update(state[key])
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=OPTIMIZER_SHARDING)
        state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = _rng_state()
    return state


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler,
                    consumed_train_samples: int) -> str:
    rank = torch.distributed.get_rank()
    final, tmp = iteration_dir(root, iteration), iteration_dir(root, iteration) + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    torch.distributed.barrier()
    extra = {"iteration": iteration, "consumed_train_samples": consumed_train_samples,
             "adam_step": adam_step(optimizer)}
    state = _sharded_state(model, optimizer, scheduler, extra, True, is_loading=False)
    dist_checkpointing.save(state, tmp)
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
    torch.distributed.barrier()
    return final


def _adam_optimizers(optimizer):
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if isinstance(torch_optimizer, torch.optim.Adam):
            yield torch_optimizer


def adam_step(optimizer) -> int:
    """How many updates Adam has applied (its bias correction depends on it)."""
    steps = [float(state["step"]) for adam in _adam_optimizers(optimizer)
             for state in adam.state.values() if "step" in state]
    return int(max(steps)) if steps else 0


def _set_adam_state(optimizer, step: int, placeholders: bool) -> None:
    """Write Adam's step into every parameter's state, each its own tensor.

    Before a load (placeholders=True) Adam has no state at all, yet
    DistributedOptimizer.state_dict() asserts one common 'step', so zero moments are put in
    as placeholders for dist_checkpointing to overwrite. After a load the step is written again:
    without Apex/TE the distributed optimizer's sharded formats do not restore it (it comes back
    as the placeholder) and its load_state_dict shares one step tensor between parameters,
    which torch's Adam would then advance once per parameter per iteration.
    """
    for adam in _adam_optimizers(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                if placeholders and not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                if state:
                    state["step"] = torch.tensor(float(step))


def _describe(error: BaseException) -> str:
    failures = getattr(error, "failures", None)  # CheckpointException: rank -> exception
    if failures:
        error = next(iter(failures.values()))
        if isinstance(error, tuple):  # (exception, traceback frames)
            error = error[0]
    text = str(error).splitlines()[0][:300] if str(error) else "unreadable or truncated shard"
    return f"{type(error).__name__}: {text}"


def load_checkpoint(root: str, model, optimizer, scheduler, load_optimizer: bool = True):
    """Load the latest checkpoint under `root` in place; returns (iteration, consumed samples).

    Raises CheckpointError, identically on every rank, when it cannot.
    """
    iteration = read_tracker(root)
    if iteration is None:
        raise CheckpointError(f"--load {root}: no {TRACKER} (no checkpoint was finished there)")
    path = iteration_dir(root, iteration)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CheckpointError(f"--load {root}: {path} is missing or incomplete")
    try:
        step = int(dist_checkpointing.load_common_state_dict(path).get("adam_step", 0))
        if load_optimizer:
            _set_adam_state(optimizer, step, placeholders=True)
        template = _sharded_state(model, optimizer, scheduler, {}, load_optimizer,
                                  is_loading=True)
        loaded = dist_checkpointing.load(template, path)
    except (Exception, CheckpointException) as error:  # many kinds; one clear message
        raise CheckpointError(f"--load {path}: cannot read checkpoint ({_describe(error)})"
                              ) from error
    for index, chunk in enumerate(model):
        unwrapped = getattr(chunk, "module", chunk)  # DDP wraps the megatron module
        unwrapped.load_state_dict(loaded["model" if len(model) == 1 else f"model{index}"])
    if load_optimizer:
        # In fp32 the distributed optimizer's main params are views of the model's leaf params;
        # its in-place copies need no_grad (with bf16 they are separate fp32 tensors).
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _set_adam_state(optimizer, step, placeholders=False)
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    _restore_rng(loaded["rng_state"])
    return int(loaded["iteration"]), int(loaded["consumed_train_samples"])
