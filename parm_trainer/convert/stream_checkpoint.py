"""The project's checkpoint written and read a tensor (or a layer) at a time, so that a model
larger than memory converts.

A model built on the meta device (single_process.build_one_rank_model(args, meta=True)) holds
every tensor's name, shape and place in a checkpoint and no data: its sharded state dict is
what dist_checkpointing saves and loads.

- LazySave is megatron-core's torch_dist strategy (the same files, tensor keys, chunks and
  metadata as dist_checkpointing.save writes; any layout loads it) whose tensors are made by a
  function only when torch's FileSystemWriter writes them: with one thread its serial loader
  resolves, writes and drops one tensor at a time. megatron's own writer resolves every tensor
  first (FileSystemWriterAsync.prepare_write_data), which would hold the whole model.
- CheckpointReader loads the named tensors of such a model from a checkpoint of any layout,
  through dist_checkpointing.load of that part of the sharded state dict alone.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItemType

from parm_trainer.convert.decoder import layer_of


def tensors_of(model) -> dict:
    """name -> tensor of the model's state dict, megatron's _extra_state entries left out."""
    return {name: value for name, value in model.state_dict(keep_vars=True).items()
            if value is not None and not name.endswith("_extra_state")}


class _LazyPlanner(MCoreSavePlanner):
    def __init__(self, resolve: Callable, **kwargs):
        super().__init__(**kwargs)
        self._resolve = resolve

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        return self._resolve(self.lookup_object(write_item.index))


class LazySave(TorchDistSaveShardedStrategy):
    """Save a meta-device model's checkpoint with make(name) -> the tensor of that state dict
    name (any dtype; cast to the model's)."""

    def __init__(self, model, make: Callable):
        super().__init__("torch_dist", 1, thread_count=1)
        self._meta = tensors_of(model)
        # a piece of the sharded state dict is a view of one parameter: its storage names it
        self._names = {tensor.untyped_storage()._cdata: name
                       for name, tensor in self._meta.items()}
        self._make, self._last = make, (None, None)

    def _tensor(self, name: str) -> torch.Tensor:
        if self._last[0] != name:  # a SwiGLU fc1 is written as two pieces, one after the other
            self._last = (None, None)
            tensor, meta = self._make(name), self._meta[name]
            if tensor.shape != meta.shape:
                raise ValueError(f"{name}: made with shape {list(tensor.shape)}, the model has "
                                 f"{list(meta.shape)}")
            self._last = (name, tensor.to(meta.dtype).contiguous())
        return self._last[1]

    def _resolve(self, piece: torch.Tensor) -> torch.Tensor:
        whole = self._tensor(self._names[piece.untyped_storage()._cdata])
        return whole.as_strided(piece.size(), piece.stride(), piece.storage_offset())

    def save(self, sharded_state_dict, checkpoint_dir):
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        torch.distributed.checkpoint.save(
            mcore_to_pyt_state_dict(flat, False),
            storage_writer=FileSystemWriter(checkpoint_dir, thread_count=1,
                                            single_file_per_rank=True),
            planner=_LazyPlanner(self._resolve, flatten_state_dict=False))
        self._last = (None, None)


def parts(model, budget: int) -> list:
    """The model's tensor names in the pieces an export reads, in state dict order: a layer's
    tensors together up to budget bytes (one at least), every other tensor (embedding, final
    norm, output layer) alone. A part is (its layer or None, its names)."""
    out, size = [], 0
    for name, tensor in tensors_of(model).items():
        layer, nbytes = layer_of(name), tensor.numel() * 4  # read as float32
        if layer is None or not out or out[-1][0] != layer or size + nbytes > budget:
            out.append((layer, []))
            size = 0
        out[-1][1].append(name)
        size += nbytes
    return out


def _whole_rank(piece):
    """A piece as a chunk of its global tensor with every axis its own: megatron's layer and
    expert axes (prepend_axis_num) are stored as a regular grid that it rebuilds on load from
    all ranks' pieces, which a part of the model does not have."""
    shape = (1,) * piece.prepend_axis_num + tuple(piece.local_shape)
    return dataclasses.replace(piece, data=piece.data.view(shape), local_shape=shape,
                               prepend_axis_num=0, axis_fragmentations=None)


class CheckpointReader:
    """Reads the named tensors of a meta-device model, as float32, from the checkpoint
    directory path (an iteration directory) of any layout: read(names) -> {name: tensor};
    stored_dtypes() -> {name: the dtype the checkpoint holds it in}."""

    def __init__(self, path: str, model):
        self.path, self.sharded = path, model.sharded_state_dict()

    def stored_dtypes(self) -> dict:
        """A bf16 run's checkpoint holds its weights in bf16 and megatron's fp32 buffers (the
        expert bias) in fp32: each tensor's dtype from the checkpoint's metadata (a factory's,
        such as SwiGLU's split fc1, from the first key it stores under its own)."""
        from torch.distributed.checkpoint import FileSystemReader

        stored = {key: getattr(meta, "properties", None) for key, meta in
                  FileSystemReader(self.path).read_metadata().state_dict_metadata.items()}
        out = {}
        for name, item in self.sharded.items():
            if isinstance(item, ShardedObject):
                continue
            key = item.key
            found = stored.get(key) or next((v for k, v in stored.items()
                                             if k.startswith(key) and v is not None), None)
            out[name] = getattr(found, "dtype", None) or torch.float32
        return out

    def read(self, names) -> dict:
        request, out, meta = {}, {}, {}
        for name in names:
            item = self.sharded[name]
            assert not isinstance(item, ShardedObject), name
            meta[name] = item.data
            item.data = out[name] = torch.empty(item.data.shape, dtype=torch.float32)
            built = item.build() if isinstance(item, ShardedTensorFactory) else item
            request[name] = dict_list_map_inplace(_whole_rank, built)
        try:
            # loaded in place: the pieces are views of out's tensors
            dist_checkpointing.load(request, self.path, validate_access_integrity=False)
        finally:
            for name, data in meta.items():  # the model's sharded state holds no data again
                self.sharded[name].data = data
        return out
