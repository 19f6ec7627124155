"""Weight initialisation that does not depend on the parallel layout.

megatron-core draws each rank's shard from that rank's RNG stream, so the same --seed gives
different weights under TP2xEP2 than on one rank. Here every weight is drawn as its full,
unsharded tensor from a generator seeded by (--seed, the tensor's checkpoint key, its layer and
expert index), and each rank keeps its own slice. Where the slice lies comes from the model's
sharded_state_dict(), the same map dist_checkpointing uses, so the rule covers every module
megatron can shard. Same seed, same model, any layout: same weights (torchtitan's check that two
layouts give identical losses rests on this). The cost is one full weight matrix at a time.
"""

from __future__ import annotations

import math
import zlib

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

# Output projections get std / sqrt(2 * num_layers), as in GPT-2 and Megatron-LM.
_SCALED = ("linear_proj.weight", "linear_fc2.weight")


def _generator(seed: int, key: str, prefix_offsets: tuple) -> torch.Generator:
    mixed = zlib.crc32(f"{seed}|{key}|{prefix_offsets}".encode())
    return torch.Generator().manual_seed(mixed)


def _draw(key: str, seed: int, std: float, prefix: tuple, shape: tuple, offsets: tuple,
          local_shape: tuple) -> torch.Tensor:
    """This rank's slice of the full tensor `shape` drawn for (seed, key, prefix). A stack of
    matrices (GroupedMLP's experts in one tensor) is drawn matrix by matrix, the stack index
    joining the prefix, so it gets the weights of SequentialMLP's experts, one tensor each."""
    if len(shape) > 2:
        return torch.stack([_draw(key, seed, std, prefix + (offsets[0] + i,), shape[1:],
                                  offsets[1:], local_shape[1:]) for i in range(local_shape[0])])
    full = torch.empty(shape).normal_(0.0, std, generator=_generator(seed, key, prefix))
    return full[tuple(slice(offset, offset + size)
                      for offset, size in zip(offsets, local_shape))]


def _full_then_slice(sharded: ShardedTensor, seed: int, std: float) -> torch.Tensor:
    prepend = sharded.prepend_axis_num
    return _draw(sharded.key, seed, std, tuple(sharded.global_offset[:prepend]),
                 tuple(sharded.global_shape[prepend:]), tuple(sharded.global_offset[prepend:]),
                 tuple(sharded.local_shape))


def _built(item):
    """(the ShardedTensors behind one sharded_state_dict entry, a function returning their
    data in the entry's own layout). A ShardedTensorFactory (SwiGLU's fc1 stored as two
    halves, GroupedMLP's experts as [n, H, M]) is built into its pieces, which may be copies of
    the parameter; its merge_fn, the one dist_checkpointing loads with, puts them back."""
    if isinstance(item, ShardedTensor):
        return [item], lambda: item.data
    if not isinstance(item, ShardedTensorFactory):
        return [], None
    pieces = []

    def walk(node):  # the built structure, each piece (or nested factory) -> its merge
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(v) for v in node]
        inner, merged = _built(node)
        pieces.extend(inner)
        return merged or node

    def fill(node):
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v) for v in node]
        return node() if callable(node) else node

    structure = walk(item.build())
    return pieces, lambda: item.merge_fn(fill(structure))


def sharded_pieces(item) -> list:
    """The ShardedTensors one sharded_state_dict entry saves (a factory's, at any depth)."""
    return _built(item)[0]


def sharded_state_dict(model: torch.nn.Module) -> dict:
    """model.sharded_state_dict(), with the metadata megatron-core's GPTModel needs on a
    multi-token prediction stage that does not hold the embedding's first copy (its copy of the
    word embedding is a replica over the data-parallel ranks: Megatron-LM's dp_cp_group)."""
    metadata = None
    if getattr(model, "mtp_process", False) and not getattr(model, "pre_process", True):
        from megatron.core import parallel_state

        metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(
            with_context_parallel=True)}
    return model.sharded_state_dict(metadata=metadata)


def init_weights_layout_free(model: torch.nn.Module, seed: int, std: float, num_layers: int) -> int:
    """Overwrite every weight matrix of `model` (an unwrapped megatron module) in place.

    Vectors (norm weights and biases) keep megatron's constant init (ones, zeros), which is
    already layout-free. Returns the number of tensors written.
    """
    written = 0
    scaled_std = std / math.sqrt(2.0 * num_layers)
    with torch.no_grad():
        for item in sharded_state_dict(model).values():
            pieces, merged = _built(item)
            drawn = 0
            for sharded in pieces:
                if len(sharded.local_shape) < 2 or sharded.flattened_range is not None:
                    continue
                this_std = scaled_std if sharded.key.endswith(_SCALED) else std
                values = _full_then_slice(sharded, seed, this_std)
                sharded.data.copy_(values.view_as(sharded.data).to(sharded.data.dtype))
                drawn += 1
            if drawn and isinstance(item, ShardedTensorFactory):  # pieces may be copies
                item.data.copy_(merged().view_as(item.data))
            written += drawn
    return written
