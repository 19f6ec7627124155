"""The tied word embedding's gradient bucket all-reduced in pieces, between the MoE exchanges.

With --overlap-grad-reduce the tied embedding's bucket is complete at the start of the last
micro-batch's backward (tied_embedding.py). Launched there in one piece, its bytes (the largest
dense gradient) take the link while the MoE layers' backward exchanges, which cross the same
link and stand on the critical path, queue behind them. Here the bucket's all-reduce goes in
one piece per MoE layer, each launched when the backward leaves that layer's MoE block (its
exchange done), so that it crosses the link while the layer's attention backward computes;
whatever is left goes when DDP finishes the gradient sync. The sums are the same numbers as
megatron-core's (one all-reduce of each element, the same scaling before it).

    PacedBucket.attach(ddp_chunk, tied_weight)   # None unless overlap, no distributed
                                                 # optimizer, the weight alone in its bucket
                                                 # and MoE layers in the chunk
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from parm_trainer.moe.layer import ParmMoELayer
from parm_trainer.training.node_buckets import bucket_reducer


def moe_blocks(module: torch.nn.Module) -> list:
    """The MoE blocks (megatron's or Parm's) of the module's transformer layers, in order."""
    return [layer.mlp for layer in module.modules() if isinstance(layer, TransformerLayer)
            and isinstance(getattr(layer, "mlp", None), (MoELayer, ParmMoELayer))]


class PacedBucket:
    """Stands in for the bucket group's start_grad_sync and, once it is called, for its
    grad_reduce_handle: wait() launches the pieces not launched yet and waits for all."""

    def __init__(self, bucket_group, blocks: list):
        self.group = bucket_group
        (self.bucket,) = bucket_group.buckets
        self.pieces = list(self.bucket.grad_data.view(-1).tensor_split(len(blocks)))
        self.op = (torch.distributed.ReduceOp.AVG if bucket_group.ddp_config.average_in_collective
                   else torch.distributed.ReduceOp.SUM)  # as megatron-core's
        self.by_node = bucket_reducer(bucket_group)  # or gloo's flat ring (None)
        self.handles = []
        self.launched = None  # pieces launched in this sync; None: no sync under way
        bucket_group.start_grad_sync = self.start
        for block in blocks:
            block.register_forward_pre_hook(self._arm, with_kwargs=True)

    @classmethod
    def attach(cls, ddp, weight: torch.nn.Parameter):
        config = ddp.ddp_config
        group = ddp.param_to_bucket_group.get(weight)
        blocks = moe_blocks(ddp.module)
        if (not config.overlap_grad_reduce or config.use_distributed_optimizer or group is None
                or [b.params for b in group.buckets] != [{weight}] or not blocks):
            return None
        return cls(group, blocks)

    def start(self, force_all_reduce: bool = False) -> None:
        """DDP's call when the bucket is complete: scale as megatron-core does, then launch
        nothing yet (the pieces go at the MoE blocks' exits, or in wait())."""
        group = self.group
        if group.is_first_batch and group.grad_reduce_handle is not None:
            return  # as megatron-core's: dispatched already in this first batch
        assert group.grad_reduce_handle is None, "a gradient sync is already under way"
        if self.bucket.gradient_scaling_factor != 1.0:
            self.bucket.grad_data *= self.bucket.gradient_scaling_factor
        self.launched = 0
        group.grad_reduce_handle = self

    def _arm(self, block, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.requires_grad:  # fires once the block's backward is done with its input
            hidden.register_hook(self._exit)

    def _exit(self, grad):
        if self.launched is not None and self.launched < len(self.pieces):
            self._launch()

    def _launch(self) -> None:
        piece = self.pieces[self.launched]
        self.handles.append(
            self.by_node.all_reduce(piece, async_op=True) if self.by_node is not None else
            torch.distributed.all_reduce(piece, op=self.op, group=self.group.data_parallel_group,
                                         async_op=True))
        self.launched += 1

    def wait(self) -> None:
        while self.launched < len(self.pieces):
            self._launch()
        for handle in self.handles:
            handle.wait()
        self.handles, self.launched = [], None
