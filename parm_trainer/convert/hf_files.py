"""A Hugging Face directory's safetensors weights, read and written one tensor at a time.

    weights = Weights("hf")                  # model.safetensors.index.json, or *.safetensors
    weights.shapes["model.norm.weight"]      # from the files' headers, nothing read
    weights.read("model.norm.weight")        # that tensor alone

    writer = ShardWriter("out", [(name, shape, dtype), ...], 5 * 10**9)
    writer.write(name, tensor)               # in the planned order
    writer.close()                           # model.safetensors.index.json if more than one

Shards are cut as transformers' save_pretrained cuts them (a tensor that would take a shard
past the size starts the next one; a larger tensor has a shard to itself), named
model-0000i-of-0000n.safetensors, or model.safetensors when there is one. The writer writes the
safetensors format directly (an 8-byte header length, the JSON header, the bytes) so that a
shard never has to be held whole.
"""

from __future__ import annotations

import glob
import json
import os
import struct

import torch

INDEX = "model.safetensors.index.json"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL"}
class Weights:
    """The tensors of a directory's safetensors files, by name."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            weight_map = json.load(open(index))["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p)
                           for p in glob.glob(os.path.join(directory, "*.safetensors")))
        self.directory, self.file, self.shapes = directory, {}, {}
        for file in files:
            with safe_open(os.path.join(directory, file), "pt") as f:
                for name in f.keys():
                    self.file[name] = file
                    self.shapes[name] = list(f.get_slice(name).get_shape())

    def __contains__(self, name: str) -> bool:
        return name in self.file

    def read(self, name: str) -> torch.Tensor:
        """One tensor; its file is opened for it and closed after, so no more of it stays
        mapped than that tensor."""
        from safetensors import safe_open

        with safe_open(os.path.join(self.directory, self.file[name]), "pt") as f:
            return f.get_tensor(name)


def _shards(plan: list, max_bytes: int) -> list:
    shards, size = [[]], 0
    for entry in plan:
        nbytes = _nbytes(entry)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _nbytes(entry) -> int:
    _, shape, dtype = entry
    count = 1
    for dim in shape:
        count *= dim
    return count * torch.empty((), dtype=dtype).element_size()


class ShardWriter:
    """Writes the planned tensors (name, shape, dtype), in order, into shards of at most
    max_bytes (a larger tensor alone)."""

    def __init__(self, directory: str, plan: list, max_bytes: int):
        self.directory = directory
        shards = _shards(plan, max_bytes)
        count = len(shards)
        self.files = ["model.safetensors"] if count == 1 else [
            f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.shards, self.total = shards, sum(_nbytes(entry) for entry in plan)
        self._order = [(i, entry) for i, shard in enumerate(shards) for entry in shard]
        self._next, self._open, self._stream = 0, None, None

    def _start(self, index: int) -> None:
        if self._stream is not None:
            self._stream.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype in self.shards[index]:
            end = offset + _nbytes((name, shape, dtype))
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, end]}
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._stream = open(os.path.join(self.directory, self.files[index]), "wb")
        self._stream.write(struct.pack("<Q", len(text)) + text)
        self._open = index

    def write(self, name: str, tensor: torch.Tensor) -> None:
        index, (planned, shape, dtype) = self._order[self._next]
        if (name, list(tensor.shape), tensor.dtype) != (planned, list(shape), dtype):
            raise ValueError(f"{name} {list(tensor.shape)} {tensor.dtype} written where the plan "
                             f"has {planned} {list(shape)} {dtype}")
        if index != self._open:
            self._start(index)
        flat = tensor.detach().contiguous().reshape(-1)
        self._stream.write(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
        self._next += 1

    def close(self) -> None:
        """Finish the last shard; write the index when there are several."""
        if self._next != len(self._order):
            raise ValueError(f"{len(self._order) - self._next} planned tensors never written")
        if self._stream is not None:
            self._stream.close()
        if len(self.files) > 1:
            weight_map = {name: self.files[i] for i, (name, _, _) in self._order}
            with open(os.path.join(self.directory, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map},
                          f, indent=2, sort_keys=True)
                f.write("\n")
