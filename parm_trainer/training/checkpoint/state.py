"""What a checkpoint holds: the layout it was saved under, the sharded state of model, optimizer,
scheduler and RNG streams (every tensor in its layout-free global shape), the run's
description (run.json), and one line for a failed save or load."""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import random as mrandom

import parm_trainer
from parm_trainer import parallel
from parm_trainer.data.input_files import TOKENIZER_FILE_FLAGS
from parm_trainer.models.init import sharded_state_dict
from parm_trainer.training.checkpoint.files import DESCRIPTION, tokenizer_copy
from parm_trainer.training.checkpoint.optimizer_state import step_for_empty_optimizers


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


def restore_rng(gathered: list) -> None:
    state = gathered[parallel_state.get_data_parallel_rank()]
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    mrandom.get_cuda_rng_tracker().set_states(state["tracker"])


def optimizer_metadata(fully_reshardable: bool, mem_efficient: bool = False) -> dict:
    return {"distrib_optim_sharding_type":
            "fully_reshardable" if fully_reshardable else "dp_reshardable",
            "distrib_optim_fully_reshardable_mem_efficient": mem_efficient}


SCHEDULER_COUNTS = "samples"  # what the LR schedule's steps count (training/lr_schedule.py)
_SCHEDULER_LENGTHS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def scheduler_in_samples(saved: dict, common: dict) -> dict:
    """The LR schedule's saved state, counted in samples as this version steps it. A checkpoint
    that does not say (saved before the schedule counted samples) counted iterations of one
    global batch each, constant then: its position and lengths are scaled by that batch."""
    if common.get("scheduler_counts") == SCHEDULER_COUNTS or not common.get("iteration"):
        return saved
    batch = common["consumed_train_samples"] // common["iteration"]
    return {key: value * batch if key in _SCHEDULER_LENGTHS else value
            for key, value in saved.items()}


def sharded_state(model, optimizer, scheduler, extra: dict, optimizer_metadata: Optional[dict],
                   is_loading: bool, with_rng: bool = True) -> dict:
    """What dist_checkpointing saves or loads; optimizer_metadata None leaves the optimizer out."""
    state = dict(extra)
    model_state = {}
    for index, chunk in enumerate(model):
        key = "model" if len(model) == 1 else f"model{index}"
        state[key] = sharded_state_dict(getattr(chunk, "module", chunk))  # without DDP's prefix
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


def write_description(args, iteration: int, directory: str) -> None:
    with open(os.path.join(directory, DESCRIPTION), "w") as f:
        json.dump(describe_run(args, iteration), f, indent=1)
    # the files the run's tokenizer type reads, so tools/generate.py needs no tokenizer flag
    kind = getattr(args, "tokenizer_type", None)
    for dest in TOKENIZER_FILE_FLAGS.get(kind, ()):
        source, copy = getattr(args, dest, None), os.path.join(directory,
                                                               tokenizer_copy(kind, dest))
        if source and os.path.isfile(source):
            shutil.copyfile(source, copy)
        elif source and os.path.isdir(source) and hasattr(args.tokenizer, "save"):
            args.tokenizer.save(copy)  # the tokenizer's files, not a model's weights beside


def describe_error(error: BaseException) -> str:
    failures = getattr(error, "failures", None)  # CheckpointException: rank -> exception
    if failures:
        error = next(iter(failures.values()))
        if isinstance(error, tuple):  # (exception, traceback frames)
            error = error[0]
    text = str(error).splitlines()[0][:300] if str(error) else "unreadable or truncated shard"
    return f"{type(error).__name__}: {text}"
