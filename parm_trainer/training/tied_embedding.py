"""The tied word embedding's gradient, reduced over data parallelism while the backward runs.

With the word embedding tied to the output layer on one pipeline stage, autograd completes the
weight's gradient only when the backward reaches the lookup, its very last step, so megatron-
core's DDP reduces it after the backward, exposed: the largest dense gradient of a small model
(80 % of the dense bytes of `make demo`'s), across the nodes. Here the lookup's gradient does
not reach the weight through autograd: its rows are added to the weight's main_grad directly
(micro-batches before the last) or kept (the last one) and reduced sparsely, exactly, after
DDP's own reduction. The weight's autograd gradient then comes from the output layer alone and
is complete at the start of the last micro-batch's backward; with --overlap-grad-reduce and
the weight in a gradient bucket of its own (bucket_size_isolating), DDP reduces it while the
rest of the backward runs.

    sink = TiedEmbeddingGrad.attach(ddp_chunk)   # None where the chunk has no tied embedding
    ... forward/backward ...; ddp_chunk.finish_grad_sync(); sink.reduce()
    (training/setup.py's DDP calls reduce() at the end of its finish_grad_sync)
"""

from __future__ import annotations

import types

import torch
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region)


def tied_word_embedding(module: torch.nn.Module):
    """The word embedding module of a language model whose output layer uses its weight on
    this same stage (megatron's share_embeddings_and_output_weights, pre and post process),
    else None."""
    if not (getattr(module, "share_embeddings_and_output_weights", False)
            and getattr(module, "pre_process", False) and getattr(module, "post_process", False)):
        return None
    return module.embedding.word_embeddings


def bucket_size_isolating(params: list, weight: torch.nn.Parameter, bucket_size: int) -> int:
    """The largest bucket size <= bucket_size with which megatron-core's bucketing (over the
    parameters in reverse order, a bucket closing once it holds >= bucket_size elements; no
    padding without the distributed optimizer) gives `weight` a bucket of its own.

    params: the dense parameters of weight's buffer, in the module's order."""
    sizes = [param.numel() for param in reversed(params)]
    at = next(i for i, param in enumerate(reversed(params)) if param is weight)
    bucket = min(bucket_size, sizes[at])  # a bucket that starts with weight ends with it
    while True:
        filled = 0
        for size in sizes[:at]:
            filled += size
            if filled >= bucket:
                filled = 0
        if filled == 0:
            return bucket
        bucket = filled  # strictly smaller: the loop ends (at worst every parameter alone)


class _Lookup(torch.autograd.Function):
    """weight's rows for ids (zero where an id is -1: another rank's vocabulary); the backward
    hands the rows' gradients to the sink instead of returning a gradient for weight, so the
    lookup adds no autograd edge to weight. `anchor` (a leaf that requires grad) puts the
    lookup in the graph."""

    @staticmethod
    def forward(ctx, ids, weight, anchor, sink):
        ctx.sink = sink
        ctx.save_for_backward(ids)
        rows = weight.index_select(0, ids.clamp(min=0).reshape(-1))
        rows = rows.view(*ids.shape, weight.shape[1])
        return rows.masked_fill_((ids < 0).unsqueeze(-1), 0.0)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        mine = ids >= 0
        ctx.sink.add(ids[mine], grad[mine])
        return None, None, None, None


def _forward(sink, module, input_):
    """VocabParallelEmbedding's forward, its lookup through _Lookup."""
    ids = input_
    if module.tp_group.size() > 1:
        outside = (input_ < module.vocab_start_index) | (input_ >= module.vocab_end_index)
        ids = (input_ - module.vocab_start_index).masked_fill(outside, -1)
    output = _Lookup.apply(ids, module.weight.detach(), sink.anchor, sink)
    if module.reduce_scatter_embeddings:  # [b s h] -> [s b h], as megatron's
        output = output.transpose(0, 1).contiguous()
        return reduce_scatter_to_sequence_parallel_region(output, group=module.tp_group)
    return reduce_from_tensor_model_parallel_region(output, group=module.tp_group)


class TiedEmbeddingGrad:
    """The lookup's share of the tied weight's gradient, outside autograd (module docstring)."""

    def __init__(self, ddp, weight: torch.nn.Parameter):
        self.ddp, self.weight = ddp, weight
        self.anchor = torch.zeros((), device=weight.device, requires_grad=True)
        self.kept = []
        self.last_path = None  # how reduce() last summed the kept rows: "local", "sparse", "dense"

    @classmethod
    def attach(cls, ddp):
        """Route the chunk's tied-embedding lookup through a sink; None where it has none."""
        embedding = tied_word_embedding(ddp.module)
        if embedding is None:
            return None
        sink = cls(ddp, embedding.weight)
        embedding.forward = types.MethodType(
            lambda module, input_: _forward(sink, module, input_), embedding)
        return sink

    def _bucket_group(self):
        return self.ddp.param_to_bucket_group[self.weight]

    def add(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        main = self.weight.main_grad
        rows = rows.to(main.dtype)
        if self._bucket_group().is_last_microbatch:  # DDP may be reducing main_grad now
            self.kept.append((ids, rows))
        else:
            main.index_add_(0, ids, rows)

    def reduce(self) -> None:
        """Add the kept rows, summed over the weight's data-parallel group and scaled as DDP
        scales its buckets, to the weight's main_grad: call after DDP's finish_grad_sync."""
        kept, self.kept = self.kept, []
        main = self.weight.main_grad
        group_of = self._bucket_group()
        config = group_of.ddp_config
        group = (group_of.intra_distributed_optimizer_instance_group
                 if config.use_distributed_optimizer else group_of.data_parallel_group)
        ranks = group.size()
        scale = group_of.param_to_bucket[self.weight].gradient_scaling_factor
        if config.average_in_collective:
            scale /= ranks
        if kept:
            ids, inverse = torch.unique(torch.cat([i for i, _ in kept]), return_inverse=True)
            rows = main.new_zeros(len(ids), main.shape[1]).index_add_(
                0, inverse, torch.cat([r for _, r in kept]))
        else:
            ids, rows = main.new_zeros(0, dtype=torch.long), main.new_zeros(0, main.shape[1])
        if ranks == 1:
            main.index_add_(0, ids, rows, alpha=scale)
            self.last_path = "local"
            return
        counts = torch.zeros(ranks, dtype=torch.long, device=main.device)
        torch.distributed.all_gather_into_tensor(
            counts, torch.tensor([len(ids)], device=main.device), group=group)
        most = int(counts.max())
        if ranks * most * (main.shape[1] + 1) >= 2 * main.numel():  # a dense sum is cheaper
            dense = torch.zeros_like(main).index_add_(0, ids, rows)
            torch.distributed.all_reduce(dense, group=group)
            main.add_(dense, alpha=scale)
            self.last_path = "dense"
            return
        padded_ids = torch.zeros(most, dtype=torch.long, device=main.device)
        padded_ids[:len(ids)] = ids
        padded_rows = main.new_zeros(most, main.shape[1])
        padded_rows[:len(ids)] = rows
        all_ids = torch.empty(ranks * most, dtype=torch.long, device=main.device)
        all_rows = main.new_empty(ranks * most, main.shape[1])
        torch.distributed.all_gather_into_tensor(all_ids, padded_ids, group=group)
        torch.distributed.all_gather_into_tensor(all_rows, padded_rows, group=group)
        for rank, count in enumerate(counts.tolist()):
            span = slice(rank * most, rank * most + count)
            main.index_add_(0, all_ids[span], all_rows[span], alpha=scale)
        self.last_path = "sparse"
