"""megatron-core's gradient buckets all-reduced node by node (node_reduce.py) where their
data-parallel group spans nodes on gloo: the bucket group's start_grad_sync replaced by one that
scales as megatron-core's does and launches the node-by-node sum of each bucket instead of the
flat ring (asynchronous under --overlap-grad-reduce, waited in DDP's finish_grad_sync).

    ByNode.attach(ddp_chunk) -> the bucket groups it took (none with the distributed optimizer,
                                an averaging collective, or no group spanning nodes)
"""

from __future__ import annotations

import torch

from parm_trainer import node_reduce


class _Handles:
    def __init__(self, handles: list):
        self.handles = handles

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()


def bucket_reducer(bucket_group):
    """The node-by-node reduction of a bucket group's all-reduce, or None where megatron-core's
    own collective stays (the distributed optimizer, an averaging collective, non-fp32 grads,
    a group within one node)."""
    config = bucket_group.ddp_config
    if config.use_distributed_optimizer or config.average_in_collective or any(
            bucket.grad_data.dtype != torch.float32 for bucket in bucket_group.buckets):
        return None
    return node_reduce.reducer(bucket_group.data_parallel_group)


class ByNode:
    """Stands in for a bucket group's start_grad_sync."""

    def __init__(self, bucket_group, reducer):
        self.group, self.reducer = bucket_group, reducer
        bucket_group.start_grad_sync = self.start

    @classmethod
    def attach(cls, ddp, skip=()) -> list:
        taken = []
        for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            reducer = bucket_reducer(group)
            if reducer is not None and group not in skip:
                taken.append(cls(group, reducer))
        return taken

    def start(self, force_all_reduce: bool = False) -> None:
        group = self.group
        if group.is_first_batch and group.grad_reduce_handle is not None:
            return  # as megatron-core's: dispatched already in this first batch
        assert group.grad_reduce_handle is None, "a gradient sync is already under way"
        overlap = group.ddp_config.overlap_grad_reduce
        handles = []
        for bucket in group.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            handles.append(self.reducer.all_reduce(bucket.grad_data, async_op=overlap))
        group.grad_reduce_handle = _Handles(handles) if overlap else None
