"""--overlap-param-gather: where training pauses megatron-core's overlapped parameter gather.

With the distributed optimizer each data-parallel rank updates its shard of the parameters;
the shards are all-gathered before the next forward pass. With --overlap-param-gather,
megatron-core's DDP gathers them bucket by bucket inside that forward pass (its forward
pre-hooks), so between an optimizer step and the next forward the model's parameters are the
old ones. Whatever reads them outside a training forward (evaluation, a save, the end of the
run) first gathers them all and turns the hooks off, and turns them back on after, as
Megatron-LM's train() does (disable_forward_pre_hook / enable_forward_pre_hook).
"""

from __future__ import annotations

import contextlib


def overlapped(model: list) -> bool:
    """Whether these DDP chunks gather their parameters in the forward pass."""
    return bool(model) and getattr(model[0], "use_forward_hook", False)


@contextlib.contextmanager
def gathered(model: list):
    """Every parameter current (gathered, hooks off) inside; the hooks back on after."""
    if not overlapped(model):
        yield
        return
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in model:
            chunk.enable_forward_pre_hook()


def finish(model: list) -> None:
    """At the end of training: gather every parameter and leave the hooks off."""
    if overlapped(model):
        for chunk in model:
            chunk.disable_forward_pre_hook(param_sync=True)
