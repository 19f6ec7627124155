"""Micro-batch iterators over megatron datasets, resumable from a sample count.

The sampler follows Megatron-LM's pretraining order: step k of the run takes the global-batch
samples [k*B, (k+1)*B); within it, micro-step j gives data-parallel rank r the samples
[j*m*D + r*m, j*m*D + (r+1)*m) (m micro-batch size, D data-parallel size). The samples that
form each micro-batch are therefore the same for every layout with the same global batch.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from megatron.core import parallel_state

from parm_trainer.parallel import rank_device


class PretrainingSampler:
    """Yields lists of sample indices, one micro-batch for this data-parallel rank at a time."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        if total_samples <= 0:
            raise ValueError("the dataset split is empty: check --split and --data-path")
        self.total, self.consumed = total_samples, consumed_samples
        self.micro, self.rank, self.size = micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        step = self.micro * self.size
        start = self.consumed
        while start + step <= self.total:
            first = start + self.rank * self.micro
            yield list(range(first, first + self.micro))
            start += step


def micro_batch_iterator(dataset, consumed_samples: int, micro_batch_size: int,
                         num_workers: int = 0) -> Optional[Iterator]:
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 parallel_state.get_data_parallel_rank(),
                                 parallel_state.get_data_parallel_world_size())
    # A generator of its own: each new iterator draws its workers' base seed from it, which
    # from the default generator would shift dropout's stream after a resume (or after the
    # evaluation iterator restarts) and break exact resumption at TP1.
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         pin_memory=torch.cuda.is_available(),
                                         generator=torch.Generator())
    return iter(loader)


def batch_to_device(batch: dict, *keys: str) -> tuple:
    """The named tensors of a micro-batch, on this rank's device (the GPU, or the CPU)."""
    device = rank_device()
    return tuple(batch[key].to(device, non_blocking=True) for key in keys)


def cycle(make_iterator):
    """An endless iterator for evaluation: restarts the split when it runs out."""
    while True:
        iterator = make_iterator()
        if iterator is None:
            return
        yielded = False
        for item in iterator:
            yielded = True
            yield item
        if not yielded:
            return
