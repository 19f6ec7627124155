"""Adam's step through megatron-core's distributed-optimizer checkpoints without Apex/TE.

torch's Adam keeps one `step` tensor per parameter; megatron-core's DistributedOptimizer
state_dict and its sharded load formats expect Apex's fused Adam (one common step, restored by
the optimizer). The helpers here bridge the two for save.py and load.py: they read the step, put
placeholders in before a load, write the step back after it, and keep it out of the tensors
megatron copies from a checkpoint.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


def is_distributed(optimizer) -> bool:
    return any(isinstance(inner, DistributedOptimizer)
               for inner in getattr(optimizer, "chained_optimizers", [optimizer]))


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


def set_adam_state(optimizer, step: int, placeholders: bool) -> None:
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


@contextlib.contextmanager
def step_for_empty_optimizers(optimizer):
    """Without Apex/TE, DistributedOptimizer.state_dict() takes the one Adam step of its
    parameters' states (distrib_optimizer.py, `assert len(steps) == 1`); a distributed optimizer
    that holds no parameter on this rank (the expert optimizer of a pipeline stage without MoE
    layers) has none. Meanwhile its state holds one placeholder with this rank's step, which
    state_dict() reads and leaves out of what it returns."""
    step = torch.tensor(float(adam_step(optimizer)))
    empty = [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])
             if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state]
    for adam in empty:
        adam.state["step placeholder"] = {"step": step}
    try:
        yield
    finally:
        for adam in empty:
            adam.state.pop("step placeholder", None)


@contextlib.contextmanager
def step_kept_apart(optimizer):
    """Without Apex/TE, megatron-core's fully_reshardable load breaks on torch's Adam.

    DistributedOptimizer.load_state_dict first puts a 'step' into every parameter's Adam state
    (for torch's optimizer), then _set_main_param_and_optimizer_states copies each state tensor
    of that dict from the checkpoint, which has no 'step': KeyError. While loading, each
    distributed optimizer copies only the tensors the checkpoint has; set_adam_state writes
    the step afterwards.
    """
    patched = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(inner, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue

        def set_states(model_param, tensors, inner=inner, original=original):
            group, order = inner.model_param_group_index_map[model_param]
            state = inner.optimizer.state[inner.optimizer.param_groups[group]["params"][order]]
            step = state.pop("step", None)
            try:
                original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        inner._set_main_param_and_optimizer_states = set_states
        patched.append(inner)
    try:
        yield
    finally:
        for inner in patched:
            del inner._set_main_param_and_optimizer_states


def with_common_steps(loaded, step: int):
    """A loaded plain (not distributed) optimizer state in which every optimizer's part that
    holds parameter states has megatron-core's `common_step`.

    megatron-core saves the step of each chained optimizer as 'common_step' in the common state,
    which dist_checkpointing writes from rank 0 alone: where rank 0 held no parameter of an
    optimizer (the expert optimizer of a first pipeline stage without MoE layers) the checkpoint
    has none, and the ranks that do hold some would give torch's Adam states without a 'step'
    (KeyError in its load_state_dict). The step put in is overwritten by set_adam_state."""
    if isinstance(loaded, dict):
        state = loaded.get("state")
        if (isinstance(state, dict) and "param_groups" in loaded
                and any(key != "common_step" for key in state)):
            state.setdefault("common_step", torch.tensor(float(step)))
        for value in loaded.values():
            with_common_steps(value, step)
    elif isinstance(loaded, (list, tuple)):
        for value in loaded:
            with_common_steps(value, step)
    return loaded
