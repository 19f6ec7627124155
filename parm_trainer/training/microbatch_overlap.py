"""Two micro-batches in flight, taking turns, so that one computes while the other's MoE
exchange travels (--overlap-moe-expert-parallel-comm, without pipeline parallelism).

megatron's schedule without pipelining runs each micro-batch's forward and backward before the
next one starts, so while a MoE layer's exchange crosses the link the rank has nothing to do.
Here the micro-batches go in pairs: each of a pair runs forward_step and backward_step (megatron's
own) on a thread of its own, and the two take turns (moe/turns.py): where one would wait on its
exchange's expert-parallel AlltoAll it hands over, and the other computes (its attention, its
experts, its backward) until it must wait in turn. Only one computes at any time, the turns
change at the same points of the program on every rank, and every gradient is the sum of the
same micro-batches' gradients as in the sequential schedule (the order of the additions may
differ). The pair's activations are held together: about one micro-batch more than the
sequential schedule at the peak.

The pairs before the last run under DDP's no_sync, as megatron's micro-batches before the last;
the last pair does not, so both its micro-batches mark their gradients ready, and megatron-core's
DDP, which learns in the first iteration how many times each parameter becomes ready in the last
micro-batch (golden counts: 2 here), starts a bucket's reduction once both have added to it.

Timers (--timing-log-level 1 and 2) stop while their thread has handed the turn over, so
megatron's forward-compute and backward-compute and the MoE layers' step times count each
micro-batch's own time. On CUDA, autograd runs the backward's CUDA nodes on a device thread of
its own, which holds no turn: there only the forwards hand over.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
from megatron.core.utils import get_model_config, get_model_type

from parm_trainer.moe.turns import Turns
from parm_trainer.planning.paired_microbatches import IN_FLIGHT, not_applied

_TURNS = Turns(IN_FLIGHT)  # its threads start at the first pair and are kept


class _TurnTimers:
    """config.timers as the micro-batches' threads see it: a timer a thread started (megatron's
    forward-compute, backward-compute) stops while that thread has handed the turn over and
    starts again when it gets it back, so each adds only its own micro-batch's time."""

    def __init__(self, timers):
        self.timers = timers
        self.local = threading.local()  # .running: the timers this thread started

    def __call__(self, name, log_level=None):
        timer = self.timers(name) if log_level is None else self.timers(name, log_level)
        return _TurnTimer(timer, self.local)

    def leave(self):
        for timer in getattr(self.local, "running", ()):
            timer.stop()

    def back(self):
        for timer in getattr(self.local, "running", ()):
            timer.start()


class _TurnTimer:
    def __init__(self, timer, local):
        self.timer, self.local = timer, local

    def start(self, barrier=False):
        self.timer.start(barrier=barrier)
        self.local.__dict__.setdefault("running", []).append(self.timer)

    def stop(self, barrier=False):
        self.local.running.remove(self.timer)
        self.timer.stop(barrier=barrier)


def usable(args, forward_only: bool, microbatches: int = None) -> bool:
    """Whether this call of the schedule (training, or evaluation: forward_only) runs here.
    microbatches: this call's (default args.num_microbatches; a ramp-up's early iterations
    may have one, which runs megatron's schedule)."""
    return (getattr(args, "overlap_moe_expert_parallel_comm", False) and not forward_only
            and not_applied(args, microbatches) is None)


def forward_backward_overlapped(*, forward_step_func, data_iterator, model, num_microbatches,
                                seq_length=None, micro_batch_size=None, forward_only=False,
                                around=None):
    """megatron-core's forward_backward_no_pipelining, with the micro-batches run in pairs that
    take turns (the module's docstring). Returns the forward data store, in micro-batch order.
    around: a context factory each micro-batch runs in, on its thread (the memory probe's
    saved-tensor hooks, which are per thread)."""
    assert not forward_only, "the overlapped schedule trains; evaluation runs megatron's own"
    if isinstance(model, list):
        (model,) = model
    if isinstance(data_iterator, list):
        (data_iterator,) = data_iterator
    config = get_model_config(model)
    if config.timers is not None:
        config.timers('forward-backward', log_level=1).start(barrier=config.barrier_with_L1_time)
    no_sync = config.no_sync_func or contextlib.nullcontext
    model_type = get_model_type(model)
    cp_size = parallel_state.get_context_parallel_world_size()
    timers = _TurnTimers(config.timers) if config.timers is not None else None
    step_config = config
    if timers is not None:  # (the model's modules keep the config itself)
        step_config = copy.copy(config)
        step_config.timers = timers
    stores = [[] for _ in range(num_microbatches)]
    tokens = [None] * num_microbatches

    def micro_batch(i):
        with around() if around is not None else contextlib.nullcontext():
            output, tokens[i] = forward_step(
                forward_step_func, data_iterator, model, num_microbatches, None, stores[i],
                step_config, cp_size, is_first_microbatch=i == 0, current_microbatch=i)
            backward_step(None, output, None, model_type, step_config)

    for first in range(0, num_microbatches, IN_FLIGHT):
        group = range(first, min(first + IN_FLIGHT, num_microbatches))
        last = group[-1] == num_microbatches - 1
        with contextlib.nullcontext() if last else no_sync():
            _TURNS.run([lambda i=i: micro_batch(i) for i in group],
                      on_leave=timers and timers.leave, on_back=timers and timers.back)
    if config.finalize_model_grads_func is not None:
        total = sum(tokens, torch.zeros([], dtype=torch.int))
        config.finalize_model_grads_func(
            [model], total if config.calculate_per_token_loss else None)
    if config.timers is not None:
        config.timers('forward-backward').stop()
    return [item for store in stores for item in store]
