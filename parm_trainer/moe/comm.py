"""Autograd-aware collectives for the MoE layer, with per-rank byte accounting.

Every op takes a torch.distributed process group and a short name for it ("ep", "esp", "mp")
that the accounting uses. A group of size 1 (or None) makes the op the identity in both
directions and records nothing. Each op is a torch.autograd.Function whose backward is the
exact dual of its forward:

    all_to_all(x)                  backward: all_to_all
    all_gather(x, dim)             backward: reduce_scatter (each rank uses the result its own way)
    reduce_scatter(x, dim)         backward: all_gather
    all_reduce(x)                  backward: identity (a replicated sum has a replicated grad)
    split(x, dim)                  backward: all_gather            (forward sends nothing)
    gather(x, dim)                 backward: split (no comm; every rank uses the result alike)
    copy_to(x)                     backward: all_reduce            (forward sends nothing)
    start(kind, x) / finish(...)   the same collectives issued now and waited for later, whose
                                   backwards swap roles (the MoE layer's pipelined exchange)

Byte accounting. LEDGER records what THIS rank sends and receives over the network for a group
of W ranks (data that stays on the rank is not counted; ring volumes):

    alltoall       input of B bytes (W blocks of B/W)   sent = received = B * (W-1) / W
    allgather      local piece of b bytes               sent = received = b * (W-1)
    reducescatter  input of B bytes (W blocks of B/W)   sent = received = B * (W-1) / W
    allreduce      tensor of B bytes                    sent = received = 2 * B * (W-1) / W

(the AllReduce figure is rounded down to whole bytes). Entries are keyed kind/group/phase,
phase being "forward" or "backward". A started collective records its bytes like the blocking
one, so a plan's totals are the same whether its exchange runs in one piece or in several.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from parm_trainer.moe import step_timing

EP_GROUPS = ("ep", "ep_link")  # the expert-parallel exchange's groups (ep_link: relayed)
KINDS = ("alltoall", "allgather", "reducescatter", "allreduce")
PHASES = ("forward", "backward")


class CommLedger:
    """Bytes this rank sent and received, keyed (kind, group name, phase)."""

    def __init__(self):
        self._lock = threading.Lock()  # backward may run on autograd's device threads
        self._rows: dict[tuple[str, str, str], dict[str, int]] = {}

    def record(self, kind, group_name, sent_bytes, received_bytes, phase="forward"):
        if kind not in KINDS or phase not in PHASES:
            raise ValueError(f"unknown collective kind {kind!r} or phase {phase!r}")
        with self._lock:
            row = self._rows.setdefault((kind, group_name, phase),
                                        {"sent": 0, "received": 0, "calls": 0})
            row["sent"] += int(sent_bytes)
            row["received"] += int(received_bytes)
            row["calls"] += 1

    def reset(self):
        with self._lock:
            self._rows.clear()

    def totals(self, phase=None, per_phase=False):
        """{"kind/group": {"sent", "received", "calls"}}, summed over both phases or only
        `phase`; per_phase=True keys the rows "kind/group/phase" instead."""
        return self._sum(lambda k, g, p: f"{k}/{g}/{p}" if per_phase else f"{k}/{g}", phase)

    def by_kind(self, phase=None):
        """{"kind": {"sent", "received", "calls"}}, summed over groups (and phases)."""
        return self._sum(lambda k, g, p: k, phase)

    def _sum(self, key_of, phase):
        if phase is not None and phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for (kind, group, row_phase), row in self._rows.items():
                if phase is None or row_phase == phase:
                    acc = out.setdefault(key_of(kind, group, row_phase),
                                         {"sent": 0, "received": 0, "calls": 0})
                    for field in acc:
                        acc[field] += row[field]
        return out


LEDGER = CommLedger()


# --- groups, layouts and the raw (asynchronous) collectives --------------------------------

def group_size(group) -> int:
    """Ranks in `group`; None (or no initialised process group) counts as a group of one."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


class _Done:
    """The handle of a collective that needed no communication (a group of one)."""

    def wait(self):
        return True


def _check_divisible(size, world, what):
    if size % world:
        raise ValueError(f"{what}: size {size} does not divide into {world} equal blocks")


def _blocks(x, dim, world):
    """x cut into `world` equal blocks along dim, stacked on a new dim 0 (contiguous)."""
    _check_divisible(x.shape[dim], world, "blocks")
    return x.unflatten(dim, (world, -1)).movedim(dim, 0).contiguous()


def _unblock(stacked, dim):
    """Inverse of _blocks: the blocks of stacked dim 0 concatenated along dim."""
    return stacked.movedim(0, dim).flatten(dim, dim + 1)


def _issue_all_to_all(x, group):
    """Start an AlltoAll of x's dim-0 blocks; returns (handle, output)."""
    world = group_size(group)
    if world == 1:
        return _Done(), x
    _check_divisible(x.shape[0], world, "all_to_all dim 0")
    x = x.contiguous()
    out = torch.empty_like(x)
    return dist.all_to_all_single(out, x, group=group, async_op=True), out


def _issue_all_gather(x, group):
    """Start an AllGather of x; returns (handle, output stacked as (W, *x.shape))."""
    world = group_size(group)
    if world == 1:
        return _Done(), x.unsqueeze(0)
    x = x.contiguous()
    out = x.new_empty((world, *x.shape))
    # Flat views: gloo accepts only the concatenated form of the output, NCCL both.
    work = dist.all_gather_into_tensor(out.view(-1), x.view(-1), group=group, async_op=True)
    return work, out


def _issue_reduce_scatter(stacked, group):
    """Start a ReduceScatter (sum) of stacked (W, ...) blocks; returns (handle, this rank's)."""
    if group_size(group) == 1:
        return _Done(), stacked[0]
    stacked = stacked.contiguous()
    out = stacked.new_empty(stacked.shape[1:])
    work = dist.reduce_scatter_tensor(out.view(-1), stacked.view(-1), group=group,
                                      async_op=True)
    return work, out


def _record(kind, name, nbytes, world, phase):
    """Record one collective over `world` ranks whose input on this rank is nbytes long,
    with the formulas of the module docstring; a group of one records nothing."""
    if world == 1:
        return
    if kind == "allgather":
        volume = nbytes * (world - 1)
    else:
        volume = (2 if kind == "allreduce" else 1) * nbytes * (world - 1) // world
    LEDGER.record(kind, name, volume, volume, phase)


# --- blocking collectives: fn(x, group, name, [dim,] phase) -> tensor ----------------------

def _a2a(x, group, name, phase):
    work, out = _issue_all_to_all(x, group)
    step_timing.wait(work)
    _record("alltoall", name, x.nbytes, group_size(group), phase)
    return out


def _ag(x, group, name, dim, phase):
    work, stacked = _issue_all_gather(x, group)
    step_timing.wait(work)
    _record("allgather", name, x.nbytes, group_size(group), phase)
    return _unblock(stacked, dim)


def _rs(x, group, name, dim, phase):
    world = group_size(group)
    work, out = _issue_reduce_scatter(_blocks(x, dim, world), group)
    step_timing.wait(work)
    _record("reducescatter", name, x.nbytes, world, phase)
    return out


def _ar(x, group, name, phase):
    out = x.clone(memory_format=torch.contiguous_format)
    step_timing.wait(dist.all_reduce(out, group=group, async_op=True))
    _record("allreduce", name, x.nbytes, group_size(group), phase)
    return out


def _split(x, group, name, dim, phase):
    world = group_size(group)
    _check_divisible(x.shape[dim], world, "split")
    return x.chunk(world, dim)[dist.get_rank(group)].contiguous()


def _identity(x, group, name, phase):
    return x


# --- pieces --------------------------------------------------------------------------------

def piece_spans(length, count):
    """(offset, size) of each piece torch.tensor_split(range(length), count) makes, empty
    pieces left out."""
    base, extra = divmod(length, count)
    spans, offset = [], 0
    for i in range(count):
        size = base + (i < extra)
        if size:
            spans.append((offset, size))
        offset += size
    return spans


# --- autograd functions --------------------------------------------------------------------

def _dual_op(class_name, forward, backward):
    """An autograd.Function computing forward(x, *args, phase="forward") whose backward is
    backward(grad, *args, phase="backward"); args are the non-tensor groups, names, dims."""

    def fwd(ctx, x, *args):
        ctx.args = args
        return forward(x, *args, phase="forward")

    def bwd(ctx, grad):
        return (backward(grad, *ctx.args, phase="backward"),) + (None,) * len(ctx.args)

    return type(class_name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_AllToAll = _dual_op("_AllToAll", _a2a, _a2a)
_AllGather = _dual_op("_AllGather", _ag, _rs)
_ReduceScatter = _dual_op("_ReduceScatter", _rs, _ag)
_AllReduce = _dual_op("_AllReduce", _ar, _identity)
_Split = _dual_op("_Split", _split, _ag)
_Gather = _dual_op("_Gather", _ag, _split)
_CopyTo = _dual_op("_CopyTo", _identity, _ar)


# --- public ops ----------------------------------------------------------------------------

def all_to_all(x, group, name):
    """Block j of x's dim 0 goes to rank j; output block i came from rank i."""
    return x if group_size(group) == 1 else _AllToAll.apply(x, group, name)


def all_gather(x, group, name, dim=0):
    """Every rank's x concatenated along dim; backward reduce-scatters the grad."""
    return x if group_size(group) == 1 else _AllGather.apply(x, group, name, dim % x.dim())


def reduce_scatter(x, group, name, dim=0):
    """Sum over ranks, keeping this rank's block along dim; backward all-gathers the grad."""
    return x if group_size(group) == 1 else _ReduceScatter.apply(x, group, name, dim % x.dim())


def all_reduce(x, group, name):
    """Sum over ranks; the result is replicated, its grad passes through unchanged."""
    return x if group_size(group) == 1 else _AllReduce.apply(x, group, name)


def split(x, group, name, dim):
    """This rank's block of a replicated x along dim; backward all-gathers the grad."""
    return x if group_size(group) == 1 else _Split.apply(x, group, name, dim % x.dim())


def gather(x, group, name, dim):
    """AllGather for a result every rank then uses identically; backward keeps this rank's
    block of the (replicated) grad."""
    return x if group_size(group) == 1 else _Gather.apply(x, group, name, dim % x.dim())


def copy_to(x, group, name):
    """Identity for a replicated x feeding rank-specific work; backward all-reduces the grad."""
    return x if group_size(group) == 1 else _CopyTo.apply(x, group, name)


# --- asynchronous collectives: start now, finish later, in both directions -----------------
#
# start(kind, x, ...) issues the collective and returns at once; finish(pending) waits for it
# and returns the result. Each is an autograd Function, and their backwards swap roles:
# finish's backward STARTS the dual collective of the grad and start's backward FINISHES it.
# Autograd runs ready nodes latest-created first, so the backward replays the forward's
# schedule in reverse: what overlapped in the forward overlaps in the backward too, with no
# scheduler of its own. The grad passed from finish's backward to start's is a placeholder
# (a broadcast zero); the real one travels in the pair's shared _Pending.

class _Pending:
    """One started collective: its kind, group, dim, and the forward and backward handles."""

    def __init__(self, kind, group, name, dim):
        self.kind, self.group, self.name, self.dim = kind, group, name, dim
        self.world = group_size(group)
        self.raw = self.work = self.grad_work = self.grad_raw = None

    # forward: issue and finish; backward: issue_grad and finish_grad (the dual collective)
    def issue(self, x):
        if self.kind == "alltoall":
            return _issue_all_to_all(x, self.group)
        if self.kind in ("allgather", "gather"):
            return _issue_all_gather(x, self.group)
        return _issue_reduce_scatter(_blocks(x, self.dim, self.world), self.group)

    def finish(self, raw):
        return _unblock(raw, self.dim) if self.kind in ("allgather", "gather") else raw

    def issue_grad(self, grad):
        if self.kind == "alltoall":
            return _issue_all_to_all(grad, self.group)
        if self.kind == "allgather":
            return _issue_reduce_scatter(_blocks(grad, self.dim, self.world), self.group)
        if self.kind == "gather":  # a result used alike by every rank: keep this rank's block
            return _Done(), _split(grad, self.group, self.name, self.dim, "backward")
        return _issue_all_gather(grad, self.group)

    def finish_grad(self, raw):
        return _unblock(raw, self.dim) if self.kind == "reducescatter" else raw

    def record(self, nbytes, phase):
        kind = {"gather": "allgather"}.get(self.kind, self.kind)
        if phase == "backward":
            kind = {"allgather": "reducescatter", "reducescatter": "allgather"}.get(kind, kind)
            if self.kind == "gather":
                return
        _record(kind, self.name, nbytes, self.world, phase)


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pending):
        pending.work, raw = pending.issue(x)
        pending.record(x.nbytes, "forward")
        ctx.pending = pending
        return raw

    @staticmethod
    def backward(ctx, _placeholder):
        pending = ctx.pending
        step_timing.wait(pending.grad_work, hand_over=pending.name in EP_GROUPS)
        raw, pending.grad_work, pending.grad_raw = pending.grad_raw, None, None
        return pending.finish_grad(raw), None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, raw, pending):
        step_timing.wait(pending.work, hand_over=pending.name in EP_GROUPS)
        # a finished handle is let go: it holds its output, whose grad_fn holds this pending
        # (a cycle through C++ that the garbage collector cannot see, leaking every piece)
        pending.work = None
        ctx.pending, ctx.raw_shape = pending, raw.shape
        out = pending.finish(raw)
        return out.view_as(out) if out is raw else out  # a new tensor object, no copy

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        grad = grad.contiguous()
        pending.grad_work, pending.grad_raw = pending.issue_grad(grad)
        pending.record(grad.nbytes, "backward")
        return grad.new_zeros(()).expand(ctx.raw_shape), None


def start(kind, x, group, name, dim=0):
    """Issue collective `kind` ("alltoall", "allgather", "reducescatter", or "gather": an
    AllGather whose result every rank uses alike, so its backward only splits) on x and return
    at once; pass the result to finish(). Its backward is issued and waited the same way.
    A group of one is the identity."""
    if group_size(group) == 1:
        return x, None
    pending = _Pending(kind, group, name, dim % x.dim())
    return _Start.apply(x, pending), pending


def finish(started):
    """Wait for a start()ed collective; its result, like the blocking op's."""
    raw, pending = started
    return raw if pending is None else _Finish.apply(raw, pending)
