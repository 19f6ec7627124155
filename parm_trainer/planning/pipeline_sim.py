"""1F1B on ranks that share cores: the pipeline played out step by step.

Where ranks share cores (Profile.compute_concurrency: a CPU host running several ranks), a rank
waiting in a bubble or on its neighbour leaves the cores to the ranks that compute, and those
run faster. A closed form over the steps (stages._pipeline_steps) prices that only on average;
here each rank runs megatron's 1F1B order (warm-up forwards, then one forward and one backward
at a time, then the cool-down backwards), a task starts when the neighbour it waits on is done
(a forward on the previous rank's forward of that micro-batch, a backward on the next rank's
backward of it), and at every moment the compute of the tasks running is priced at the factor
of the ranks computing at once:

    makespan = one_f_one_b(work, other, pp=2, microbatches=4, ranks_per_stage=2, factor=f)

work[r] and other[r] are {"F": s, "B": s}: pipeline rank r's compute per micro-batch at the
profile's calibrated rate (factor 1) and the rest of its time (links, waits on peers), which
run interleaved within a task, so a task computes for its share work x f / (work x f + other)
of its time; the ranks computing at once are ranks_per_stage x the sum of the running tasks'
shares, the factor of that many (a fixed point, as stages.py's steady state).
"""

from __future__ import annotations


def order(pp: int, microbatches: int) -> list:
    """Per pipeline rank, megatron's 1F1B task order: ("F" | "B", micro-batch)."""
    orders = []
    for r in range(pp):
        warm = min(pp - r - 1, microbatches)
        tasks = [("F", i) for i in range(warm)]
        for i in range(microbatches - warm):
            tasks += [("F", warm + i), ("B", i)]
        orders.append(tasks + [("B", i) for i in range(microbatches - warm, microbatches)])
    return orders


def _factor_at(tasks: dict, work: list, other: list, size: int, factor) -> float:
    f = factor(size * len(tasks))
    for _ in range(8):
        share = sum(work[r][d] * f / (work[r][d] * f + other[r][d])
                    if work[r][d] * f + other[r][d] > 0 else 0.0 for r, d in tasks.items())
        f = 0.5 * (f + factor(size * share))
    return f


def one_f_one_b(work: list, other: list, pp: int, microbatches: int, ranks_per_stage: int,
                factor) -> float:
    """Seconds from the first forward to the last backward (module docstring)."""
    orders, done, at = order(pp, microbatches), set(), [0] * pp
    left = [None] * pp  # the share of its current task a rank has still to run
    clock = 0.0

    def ready(r):
        d, i = orders[r][at[r]]
        if d == "F":
            return r == 0 or ("F", r - 1, i) in done
        return ("F", r, i) in done if r == pp - 1 else ("B", r + 1, i) in done

    while True:
        for r in range(pp):
            if left[r] is None and at[r] < len(orders[r]) and ready(r):
                left[r] = 1.0
        tasks = {r: orders[r][at[r]][0] for r in range(pp) if left[r] is not None}
        if not tasks:
            if any(a < len(o) for a, o in zip(at, orders)):
                raise RuntimeError("1F1B order deadlocked")  # not reachable for 1F1B
            return clock
        f = _factor_at(tasks, work, other, ranks_per_stage, factor)
        length = {r: work[r][d] * f + other[r][d] for r, d in tasks.items()}
        step = min(left[r] * length[r] for r in tasks)
        clock += step
        for r in tasks:
            left[r] = left[r] - step / length[r] if length[r] > 0 else 0.0
            if left[r] <= 1e-9:
                d, i = orders[r][at[r]]
                done.add((d, r, i))
                left[r], at[r] = None, at[r] + 1
