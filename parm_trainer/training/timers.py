"""--timing-log-level: where an iteration's time goes, per log interval, over the ranks.

    timers = build_timers(args)          # None at level 0: nothing is timed, nothing is reduced
    config.timers = timers               # megatron's schedules and finalize_model_grads read it
    ...
    report = interval_report(timers, iterations)   # collective; {name: (min ms, max ms)}

Level 1: megatron-core's own level-1 timers (forward-backward, all-grads-sync, the optimizer's
steps, params-all-gather), this loop's `optimizer` and `batch-generator` (the data), as
Megatron-LM's training log names them. Level 2 adds megatron's forward-compute, backward-compute
and pipeline send/receive timers, and each MoE layer's plan steps (moe/step_timing.py).
Times are per iteration, averaged over the interval; the console shows (min, max) over ranks
(--timing-log-option minmax, Megatron-LM's default), max, or every rank (all); tensorboard and
wandb get the max.
"""

from __future__ import annotations

import torch
from megatron.core.timers import Timers

from parm_trainer.moe import step_timing
from parm_trainer.parallel import rank_device

# Megatron-LM's training_log order; the names megatron-core 0.16 times at levels 1 and 2
NAMES = ("forward-backward", "forward-compute", "backward-compute", "batch-generator",
         "forward-recv", "forward-send", "backward-recv", "backward-send",
         "forward-send-forward-recv", "forward-send-backward-recv",
         "backward-send-forward-recv", "backward-send-backward-recv",
         "forward-backward-send-forward-backward-recv",
         "non-tensor-parallel-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
         "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
         "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
         "optimizer-copy-main-to-model-params", "optimizer")


def build_timers(args):
    """megatron-core's Timers at --timing-log-level, or None at level 0 (megatron's code then
    skips every timer call). Level 2 also switches on the MoE layers' step clock."""
    if not args.timing_log_level:
        return None
    if args.timing_log_level >= 2:
        step_timing.enable()
    return Timers(args.timing_log_level, args.timing_log_option)


class TimedIterator:
    """The data iterator, each next() timed as `batch-generator` (level 1)."""

    def __init__(self, iterator, timers):
        self.iterator, self.timers = iterator, timers

    def __iter__(self):
        return self

    def __next__(self):
        timer = self.timers("batch-generator", log_level=1)
        timer.start()
        try:
            return next(self.iterator)
        finally:
            timer.stop()


def _elapsed(timers, name) -> float:
    """Seconds the named timer ran since the last report (0 if it never ran), then reset.
    Asking for a timer megatron never created creates it (at level 2) or gives megatron's
    dummy, which holds nothing: only names the run has used are read."""
    if name not in timers._timers:  # noqa: SLF001 - megatron's Timers keeps no public index
        return 0.0
    return timers(name).elapsed(reset=True)


def interval_report(timers, iterations: int) -> dict:
    """{name: [ms per iteration on each rank, 0 where the rank did not run it]} for the
    level-1/2 timers and, at level 2, the MoE step clock; names no rank ran are left out.
    Collective over the world: every rank calls it at the same iterations."""
    names = list(NAMES)
    local = [_elapsed(timers, name) for name in names]
    world = torch.distributed.get_world_size()
    if step_timing.enabled():  # per-layer step names differ between stages: take their union
        moe = step_timing.collect()
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, sorted(moe))
        extra = sorted({name for names_of in everyone for name in names_of})
        names += extra
        local += [moe.get(name, 0.0) for name in extra]
    device = rank_device()
    mine = torch.tensor(local, dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(rows, mine)
    table = (torch.stack(rows).cpu() * (1e3 / max(1, iterations))).t().tolist()
    return {name: row for name, row in zip(names, table) if any(row)}


def format_report(report: dict, option: str) -> str:
    """Megatron-LM's block: '(min, max) time across ranks (ms):' and a line per timer, or the
    max only, or (option "all") every rank's time."""
    if not report:
        return ""
    if option == "all":
        lines = ["times across ranks (ms):"]
        for name, row in report.items():
            lines.append(f"  {name}:")
            lines += [f"     rank {rank:2d}: {ms:.2f}" for rank, ms in enumerate(row) if ms]
        return "\n".join(lines)
    lines = ["max time across ranks (ms):" if option == "max"
             else "(min, max) time across ranks (ms):"]
    for name, row in report.items():
        if name.startswith("moe/"):
            continue
        ran = [ms for ms in row if ms]
        value = f"{max(ran):.2f}" if option == "max" else f"({min(ran):.2f}, {max(ran):.2f})"
        lines.append(f"    {(name + ' ').ljust(48, '.')}: {value}")
    layers: dict = {}  # layer -> {STEP-fwd[-wait]: max ms}
    for name, ms in max_over_ranks(report).items():
        if name.startswith("moe/"):
            _, layer, key = name.split("/")
            layers.setdefault(int(layer[len("layer"):]), {})[key] = ms
    for layer, keys in sorted(layers.items()):
        steps, fwd, bwd = format_steps(keys)
        lines.append(f"    moe layer {layer} fwd/bwd (ms, max over ranks): {steps}"
                     f" | total {fwd:.2f}/{bwd:.2f}")
    return "\n".join(lines)


def format_steps(keys: dict) -> tuple:
    """One MoE layer's {STEP-fwd|bwd[-wait]: ms} -> ("gate 1.00/2.00 (wait 0.00/1.50) | ...",
    forward total, backward total), the steps in plan order."""
    steps = step_timing.plan_order(key[:-len("-fwd")] for key in keys if key.endswith("-fwd"))
    parts = []
    for step in steps:
        fwd, bwd = keys.get(f"{step}-fwd", 0.0), keys.get(f"{step}-bwd", 0.0)
        waits = (keys.get(f"{step}-fwd-wait", 0.0), keys.get(f"{step}-bwd-wait", 0.0))
        wait = f" (wait {waits[0]:.2f}/{waits[1]:.2f})" if any(waits) else ""
        parts.append(f"{step} {fwd:.2f}/{bwd:.2f}{wait}")
    return (" | ".join(parts), sum(keys.get(f"{s}-fwd", 0.0) for s in steps),
            sum(keys.get(f"{s}-bwd", 0.0) for s in steps))


def max_over_ranks(report: dict) -> dict:
    """{name: max ms over the ranks}: what tensorboard and wandb get."""
    return {name: max(row) for name, row in report.items()}
