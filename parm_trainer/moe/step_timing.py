"""Each MoE layer's plan steps, timed forward and backward (--timing-log-level 2).

    enable()                             # once, by the trainer at level 2
    clock = layer_clock(layer_number, plan_labels)   # None unless enabled: the executor skips
    x = clock.enter("gate", x)           # before each step: closes the last, opens this one
    x = clock.leave(x)                   # after the last step
    wait(work)                           # a collective's wait, counted apart inside its step
    collect()                            # {name: seconds since the last collect}, then reset

Forward: the wall time from one step's start to the next's. Backward: enter() and leave() put
an identity autograd node on the step's input and on the layer's output; autograd reaches the
output's node first and each input's node when that step's backward is done, so the time
between two of them is one step's backward. (Autograd runs ready nodes latest-created first, so a
step's side paths, such as the gate's through the routing probabilities, run before the node
of the step's input fires.) The waits of the exchange's collectives (each piece's AlltoAll,
AllGather, ReduceScatter) inside a step are also counted apart, as `STEP-fwd-wait` and
`STEP-bwd-wait`, so a step's compute is its time less its wait. On CUDA every boundary
synchronises the device (level 2 is for looking, not for speed); disabled, nothing is timed.

Names: moe/layer{L}/{step}-{fwd|bwd}[-wait]; a step that appears twice in a plan (the
baseline's two AlltoAlls) is numbered: a2a, a2a2.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch

from parm_trainer.moe import turns

_ENABLED = False
_TOTALS: dict = defaultdict(float)  # name -> seconds since the last collect()
_LOCAL = threading.local()  # per thread (micro-batches taking turns each have one):
# .open: the name whose time is running now (a forward or backward step), or None;
# .away: seconds this thread has been handed over (turns.py), left out of its steps' times


def _open():
    return getattr(_LOCAL, "open", None)


def _set_open(name) -> None:
    _LOCAL.open = name


def enable(on: bool = True) -> None:
    global _ENABLED
    _ENABLED = on
    _TOTALS.clear()
    _LOCAL.open = None


def enabled() -> bool:
    return _ENABLED


def collect() -> dict:
    out = dict(_TOTALS)
    _TOTALS.clear()
    return out


def _now() -> float:
    """This thread's clock: the time less the time it was handed over."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - getattr(_LOCAL, "away", 0.0)


def wait(work, hand_over: bool = False) -> None:
    """work.wait(), its time added to the open step's `-wait` when timing. hand_over: where
    micro-batches take turns (turns.py), the next one computes first (the expert-parallel
    exchange's waits, on the bytes that cross the nodes)."""
    if hand_over:
        _LOCAL.away = getattr(_LOCAL, "away", 0.0) + turns.pass_turn()
    if not _ENABLED or _open() is None:
        work.wait()
        return
    start = _now()
    work.wait()
    _TOTALS[_open() + "-wait"] += _now() - start


def labels(ops) -> list:
    """Step names of a plan's ops, a repeated op numbered from its second appearance."""
    seen: dict = defaultdict(int)
    out = []
    for op in ops:
        seen[op] += 1
        out.append(op if seen[op] == 1 else f"{op}{seen[op]}")
    return out


def plan_order(steps) -> list:
    """Step names in the order their plan runs them: the plan (schedules.py, any schedule,
    with or without sequence parallelism) whose labels are exactly these; else sorted."""
    from parm_trainer.moe.schedules import SCHEDULES, build_plan

    steps = set(steps)
    for name in SCHEDULES:
        for sequence_parallel in (True, False):
            order = labels(step.op for step in build_plan(name, sequence_parallel).steps)
            if set(order) == steps:
                return order
    return sorted(steps)


class _Backward:
    """The backward timeline: one boundary at a time, each closing the step that ran before it
    and opening the step that runs next (the one before it in the plan)."""

    def __init__(self):
        self.since = None

    def boundary(self, closing, opening) -> None:
        now = _now()
        if closing is not None and self.since is not None:
            _TOTALS[closing] += now - self.since
        self.since = now
        _set_open(opening)


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, timeline, closing, opening, *tensors):
        ctx.timeline, ctx.closing, ctx.opening = timeline, closing, opening
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.timeline.boundary(ctx.closing, ctx.opening)
        return (None, None, None, *grads)


def _mark(x, timeline, closing, opening):
    """x (a tensor, or the exact exchange's Routed: its tokens and weights) through a mark."""
    tensors = (x.tokens, x.weights) if hasattr(x, "weights") else (x,)
    if not any(t.requires_grad for t in tensors):
        return x
    out = _Mark.apply(timeline, closing, opening, *tensors)
    if hasattr(x, "weights"):
        return type(x)(*out)
    return out[0]


class LayerClock:
    """One forward pass of one MoE layer (a new clock per call)."""

    def __init__(self, layer_number: int, step_labels: list):
        self.prefix = f"moe/layer{layer_number}/"
        self.labels = step_labels
        self.index = -1
        self.since = None
        self.timeline = _Backward()

    def _close_forward(self, now):
        if self.index >= 0:
            _TOTALS[f"{self.prefix}{self.labels[self.index]}-fwd"] += now - self.since

    def enter(self, x):
        """Before the next step: its forward starts; x's mark will close its backward."""
        now = _now()
        self._close_forward(now)
        self.index += 1
        self.since = now
        name = f"{self.prefix}{self.labels[self.index]}"
        _set_open(name + "-fwd")
        before = (f"{self.prefix}{self.labels[self.index - 1]}-bwd" if self.index else None)
        return _mark(x, self.timeline, name + "-bwd", before)

    def leave(self, x):
        """After the last step: its forward ends; x's mark opens the backward of that step."""
        self._close_forward(_now())
        _set_open(None)
        return _mark(x, self.timeline, None, f"{self.prefix}{self.labels[self.index]}-bwd")


def layer_clock(layer_number, step_labels):
    return LayerClock(layer_number or 0, step_labels) if _ENABLED else None
