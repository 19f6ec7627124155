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


def _full_then_slice(sharded: ShardedTensor, seed: int, std: float) -> torch.Tensor:
    prepend = sharded.prepend_axis_num
    prefix = tuple(sharded.global_offset[:prepend])
    shape = sharded.global_shape[prepend:]
    full = torch.empty(shape).normal_(0.0, std, generator=_generator(seed, sharded.key, prefix))
    index = tuple(slice(offset, offset + size)
                  for offset, size in zip(sharded.global_offset[prepend:], sharded.local_shape))
    return full[index]


def _sharded_tensors(item):
    """The ShardedTensors behind one sharded_state_dict entry; a ShardedTensorFactory (SwiGLU's
    fc1 is stored as two halves) is built into its pieces, whose data are views of the param."""
    if isinstance(item, ShardedTensor):
        return [item]
    if isinstance(item, ShardedTensorFactory):
        built = item.build()
        pieces = built.values() if isinstance(built, dict) else built
        return [piece for part in pieces for piece in _sharded_tensors(part)]
    return []


def init_weights_layout_free(model: torch.nn.Module, seed: int, std: float, num_layers: int) -> int:
    """Overwrite every weight matrix of `model` (an unwrapped megatron module) in place.

    Vectors (norm weights and biases) keep megatron's constant init (ones, zeros), which is
    already layout-free. Returns the number of tensors written.
    """
    written = 0
    scaled_std = std / math.sqrt(2.0 * num_layers)
    with torch.no_grad():
        for item in model.sharded_state_dict().values():
            for sharded in _sharded_tensors(item):
                if len(sharded.local_shape) < 2 or sharded.flattened_range is not None:
                    continue
                this_std = scaled_std if sharded.key.endswith(_SCALED) else std
                values = _full_then_slice(sharded, seed, this_std)
                sharded.data.copy_(values.view_as(sharded.data).to(sharded.data.dtype))
                written += 1
    return written
