"""The timed step and the timing of the rows.

The median of --iters iterations after --warmup, per rank, each iteration started by a barrier
on all ranks (untimed; torch.cuda.synchronize on GPU), the schedules' iterations interleaved
as auto's start-up measurement interleaves its candidates (schedule/tune.py's interleaved_times:
every schedule's warm-up first, then one of each in turn, so a drift of the machine's speed
touches all alike, each turn in an order of its own, so none always follows the same one):
forward, backward and their sum per iteration, reported for rank 0 and as the max over ranks.
A row's time (fwd+bwd, the ratio, x floor) is the max over ranks of the median sum: a rank
slow in the forward waits less in the backward, so the sum of the two phases' maxima would
count one wait twice.
"""

from __future__ import annotations

import statistics
import time

import torch

from parm_trainer.bench.layout import sync
from parm_trainer.bench.replica import clear_tracker
from parm_trainer.schedule.tune import interleaved_times


def median(values):
    return statistics.median(values) if values else None


def timed_step(layer, forward, x_local, g_local):
    """One forward + backward of forward(x) on a fresh copy of x_local with output grad
    g_local: (x, out, forward ms, backward ms)."""
    def step():
        for p in layer.parameters():
            p.grad = None
        x = x_local.detach().clone().requires_grad_()
        sync()
        # every rank starts together: a rank's lead or lag from the step before (another
        # schedule's, when they interleave) is not charged to this one
        torch.distributed.barrier()
        t0 = time.perf_counter()
        out = forward(x)
        sync()
        t1 = time.perf_counter()
        out.backward(g_local)
        sync()
        t2 = time.perf_counter()
        return x, out, (t1 - t0) * 1e3, (t2 - t1) * 1e3
    return step


def _gathered(mine):
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    return gathered


def time_schedules(timed: dict, args) -> None:
    """Fill each result's forward_ms, backward_ms and total_ms (forward + backward of one
    iteration; its max over ranks is the row's time), the rows' iterations interleaved as the
    module docstring says. timed: {name: (result, step)}."""
    def run(name):
        clear_tracker()
        *_, f, b = timed[name][1]()
        return f, b

    times = interleaved_times(list(timed), run, args.warmup, args.iters)  # (fwd, bwd) each
    clear_tracker()
    for name, (result, _) in timed.items():
        mine = [median([t[k] for t in times[name]]) for k in range(2)]
        mine.append(median([f + b for f, b in times[name]]))
        gathered = _gathered(mine)
        for index, key in enumerate(("forward_ms", "backward_ms", "total_ms")):
            per_rank = [t[index] for t in gathered]
            result[key] = None if per_rank[0] is None else {
                "rank0": per_rank[0], "max": max(per_rank), "per_rank": per_rank}


def time_steps(timed: dict, args) -> None:
    """--step-times: each Parm row's plan steps through the level-2 step clock
    (parm_trainer/moe/step_timing.py) over --warmup + --iters more iterations. Per rank, the
    median of each step and of the steps' sums; result["step_ms"] keeps them with the
    forward + backward of the same iterations (max over ranks). A step runs inside its
    iteration's forward or backward, so the sums can never exceed those."""
    from parm_trainer.moe import step_timing

    for name, (result, step) in timed.items():
        if ":" not in result["plan"]:  # megatron's and DeepSpeed's layers have no plan steps
            continue
        step_timing.enable()
        rows = []
        for i in range(args.warmup + args.iters):
            clear_tracker()
            *_, fwd, bwd = step()
            steps = {key.split("/", 2)[2]: ms * 1e3 for key, ms in step_timing.collect().items()}
            if i >= args.warmup:
                rows.append((steps, fwd, bwd))
        step_timing.enable(False)
        keys = sorted({key for steps, _, _ in rows for key in steps})
        mine = {"steps": {key: median([steps.get(key, 0.0) for steps, _, _ in rows])
                          for key in keys},
                "fwd_steps": [sum(v for k, v in steps.items() if k.endswith("-fwd"))
                              for steps, _, _ in rows],
                "bwd_steps": [sum(v for k, v in steps.items() if k.endswith("-bwd"))
                              for steps, _, _ in rows],
                "fwd": [f for _, f, _ in rows], "bwd": [b for _, _, b in rows]}
        gathered = _gathered(mine)
        result["step_ms"] = {
            "per_rank": gathered,
            "steps_max": {key: max(g["steps"].get(key, 0.0) for g in gathered) for key in keys},
            "steps_total": max(median([f + b for f, b in zip(g["fwd_steps"], g["bwd_steps"])])
                               for g in gathered),
            "fwd_bwd_total": max(median([f + b for f, b in zip(g["fwd"], g["bwd"])])
                                 for g in gathered)}
