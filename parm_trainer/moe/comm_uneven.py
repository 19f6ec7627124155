"""Collectives of exact, uneven row counts for the MoE layer's exact exchange (exchange.py).

All three are one all_to_all_single with per-rank row counts (uneven splits work on gloo and
NCCL alike), on 2-D tensors of rows:

    alltoallv(x, send, recv)   send[j] rows of x go to rank j; recv[j] rows come from rank j
    allgatherv(x, counts)      every rank's rows, in rank order (counts[j] rows from rank j);
                               x is sent whole to every rank
    reducescatterv(x, counts)  x holds counts[j] rows for each rank j, in rank order; each rank
                               keeps the sum over ranks of its own counts[me] rows

Each has its dual as backward (AlltoAll-v with send and recv swapped; AllGather-v and
ReduceScatter-v each other's), and each can be started now and finished later through
comm.start/finish's autograd pair, so the exchange overlaps in forward and backward alike.

The ledger (comm.LEDGER) gets the exact bytes: sent = rows that leave this rank x row bytes,
received = rows that arrive from other ranks x row bytes (a rank's block to itself is a local
copy and is not counted), under the kinds "alltoall", "allgather" and "reducescatter".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parm_trainer.moe import comm, step_timing

_DUAL = {"alltoall": "alltoall", "allgather": "reducescatter", "reducescatter": "allgather"}


@dataclass(frozen=True)
class Counts:
    """Rows this rank sends to each rank and receives from each rank, and the kind: for an
    allgather the input is sent whole to every rank, for a reducescatter the received blocks
    (all of one size) are summed."""
    kind: str
    send: tuple
    recv: tuple

    def dual(self) -> "Counts":
        return Counts(_DUAL[self.kind], self.recv, self.send)


def counts_of(kind: str, rank: int, counts=None, send=None, recv=None) -> Counts:
    """The Counts of an alltoallv (send, recv) or of an allgatherv / reducescatterv whose
    ranks hold counts[j] rows each (this rank: counts[rank])."""
    if kind == "alltoall":
        return Counts(kind, tuple(map(int, send)), tuple(map(int, recv)))
    counts = tuple(map(int, counts))
    mine = (counts[rank],) * len(counts)
    return Counts(kind, mine, counts) if kind == "allgather" else Counts(kind, counts, mine)


def _issue(x, counts: Counts, group):
    """Start the all_to_all_single of `counts` on rows x; returns (handle, raw output)."""
    world = len(counts.send)
    if counts.kind == "allgather":  # the same rows to every rank
        x = x.unsqueeze(0).expand(world, *x.shape).reshape(-1, *x.shape[1:])
    x = x.contiguous()
    out = x.new_empty((sum(counts.recv), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes=list(counts.recv),
                                  input_split_sizes=list(counts.send), group=group,
                                  async_op=True)
    return work, out


def _finish(raw, counts: Counts):
    if counts.kind == "reducescatter":  # every rank's partial sums of this rank's rows
        return raw.view(len(counts.recv), counts.recv[0], *raw.shape[1:]).sum(dim=0)
    return raw


class _PendingV:
    """One started uneven collective (comm._Start / comm._Finish drive it)."""

    def __init__(self, counts: Counts, group, name, row_bytes: int):
        self.counts, self.group, self.name, self.row_bytes = counts, group, name, row_bytes
        self.rank = dist.get_rank(group)
        self.work = self.grad_work = self.grad_raw = None

    def issue(self, x):
        return _issue(x, self.counts, self.group)

    def finish(self, raw):
        return _finish(raw, self.counts)

    def issue_grad(self, grad):
        return _issue(grad, self.counts.dual(), self.group)

    def finish_grad(self, raw):
        return _finish(raw, self.counts.dual())

    def record(self, nbytes, phase):
        counts = self.counts if phase == "forward" else self.counts.dual()
        others = [j for j in range(len(counts.send)) if j != self.rank]
        sent = sum(counts.send[j] for j in others) * self.row_bytes
        received = sum(counts.recv[j] for j in others) * self.row_bytes
        comm.LEDGER.record(counts.kind, self.name, sent, received, phase)


def start(x, counts: Counts, group, name):
    """Issue the uneven collective `counts` on the rows of x (2-D) and return at once; pass
    the result to comm.finish(). A group of one is the identity."""
    if comm.group_size(group) == 1:
        return x, None
    pending = _PendingV(counts, group, name, x.shape[1] * x.element_size())
    return comm._Start.apply(x, pending), pending


def run(x, counts: Counts, group, name):
    """The blocking form: start and finish at once."""
    return comm.finish(start(x, counts, group, name))


def gather_counts(local: torch.Tensor, group) -> torch.Tensor:
    """Every rank's 1-D int64 `local` of one length, stacked in rank order (W, len). An
    all_to_all_single of `local` to every rank, as allgatherv above: one round of messages
    where a ring AllGather takes W - 1 in turn (on the emulated 2 x 2 cluster, a few dozen
    counts: 1.9 ms a call against 2.9)."""
    world = comm.group_size(group)
    if world == 1:
        return local.unsqueeze(0)
    out = local.new_empty((world, local.numel()))
    step_timing.wait(dist.all_to_all_single(out.view(-1), local.repeat(world), group=group,
                                            async_op=True))
    return out
