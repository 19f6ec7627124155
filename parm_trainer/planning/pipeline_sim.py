"""1F1B on ranks that share cores: the pipeline played out step by step.

Where ranks share cores (Profile.compute_concurrency: a CPU host running several ranks), a rank
waiting in a bubble or on its neighbour leaves the cores to the ranks that compute, and those
run faster. A closed form over the steps (stages._pipeline_steps) prices that only on average;
here each rank runs megatron's order, plain 1F1B or interleaved (warm-up forwards, then one
forward and one backward at a time, then the cool-down backwards; interleaved, V chunks per rank
in the order of megatron's schedule table), a task starts when the neighbour it waits on is done
(a forward on the previous stage's forward of that micro-batch, a backward on the next stage's
backward of it, the last stage's on its own forward), and at every moment each running task's
compute is priced at the factor of the ranks computing beside it: all of its own stage's ranks
(they compute in lock-step, between the same collectives) and the others' shares:

    makespan = one_f_one_b(work, other, pp=2, microbatches=4, ranks_per_stage=2, factor=f)

work[s] and other[s] are {"F": s, "B": s}: stage s's compute per micro-batch at the profile's
calibrated rate (factor 1) and the rest of its time (links, waits on peers), which run
interleaved within a task, so a task computes for its share work x f / (work x f + other) of
its time; beside a task, ranks_per_stage x (1 + the other running tasks' shares) ranks compute,
its factor that of so many (a fixed point: faster compute leaves more of a task waiting).
Stage s is chunk s // P of pipeline rank s % P (megatron's placement); with V = 1 the stages are
the ranks. A P2P transfer is part of the tasks at its ends (plain 1F1B: megatron's batched,
blocking send and receive) or, where megatron overlaps it with the compute (interleaved, with
overlap_p2p_comm: posted asynchronously, waited for only before the task that needs it), a
delay between the two: `transfer`.
"""

from __future__ import annotations


def warmup(pp: int, vp: int, microbatches: int, rank: int) -> int:
    """megatron's warm-up forwards on `rank`: P - rank - 1, interleaved (P - rank - 1) x 2 +
    (V - 1) x P; at most every forward."""
    count = pp - rank - 1 if vp == 1 else (pp - rank - 1) * 2 + (vp - 1) * pp
    return min(count, microbatches * vp)


def table(pp: int, vp: int, microbatches: int) -> list:
    """The forward order of (micro-batch, chunk), megatron's get_schedule_table: groups of P
    micro-batches, chunk by chunk (the last group takes what is left)."""
    if vp == 1:
        return [(i, 0) for i in range(microbatches)]
    out = []
    for start in range(0, microbatches, pp):
        end = microbatches if start + pp >= microbatches else start + pp
        out += [(i, c) for c in range(vp) for i in range(start, end)]
    return out


def order(pp: int, microbatches: int, vp: int = 1) -> list:
    """Per pipeline rank, megatron's task order: ("F" | "B", micro-batch, chunk); the backward
    runs the table's chunks mirrored (the last chunk first)."""
    forward_order = table(pp, vp, microbatches)
    forwards = [("F", i, c) for i, c in forward_order]
    backwards = [("B", i, vp - 1 - c) for i, c in forward_order]
    orders = []
    for r in range(pp):
        warm = warmup(pp, vp, microbatches, r)
        tasks = forwards[:warm]
        for k in range(len(forwards) - warm):
            tasks += [forwards[warm + k], backwards[k]]
        orders.append(tasks + backwards[len(forwards) - warm:])
    return orders


def _factors_at(tasks: dict, work: list, rest: dict, size: int, factor) -> dict:
    """{rank: the compute factor of its running task}: while a stage computes, its own `size`
    ranks all compute (they run in lock-step: the same work between the same collectives), and
    each other running stage's ranks for the share of its task they compute (rest[r]: the
    task's time that is not compute)."""
    f = {r: factor(size * len(tasks)) for r in tasks}
    for _ in range(8):
        share = {r: work[s][d] * f[r] / (work[s][d] * f[r] + rest[r])
                 if work[s][d] * f[r] + rest[r] > 0 else 0.0 for r, (s, d) in tasks.items()}
        total = sum(share.values())
        f = {r: 0.5 * (f[r] + factor(size * (1.0 + total - share[r]))) for r in tasks}
    return f


def one_f_one_b(work: list, other: list, pp: int, microbatches: int, ranks_per_stage: int,
                factor, vp: int = 1, transfer: list = None) -> float:
    """Seconds from the first forward to the last backward (module docstring). transfer[s]:
    the P2P transfer at the boundary of stages s and s + 1 where megatron overlaps it (its
    interleaved schedule with overlap_p2p_comm): in the steady phase (one forward, one
    backward) posted asynchronously after a task, a delay between its end and the neighbour's
    start; in the warm-up forwards and the cool-down backwards blocking, part of the task
    (its receive and its send, as plain 1F1B's, whose `other` includes them already)."""
    orders, done, at = order(pp, microbatches, vp), {}, [0] * pp
    left = [None] * pp  # the share of its current task a rank has still to run
    last = pp * vp - 1
    overlap = transfer is not None
    transfer = transfer or [0.0] * (pp * vp)
    clock = 0.0
    steady = []  # per rank, the positions of its tasks in the steady phase
    for r in range(pp):
        warm = warmup(pp, vp, microbatches, r)
        steady.append(range(warm, warm + 2 * (microbatches * vp - warm)))

    def blocking(r, s):
        """The P2P a task on rank r, stage s, waits on inside itself (outside the steady
        phase where megatron overlaps)."""
        if not overlap or at[r] in steady[r]:
            return 0.0
        return (transfer[s - 1] if s else 0.0) + (transfer[s] if s < last else 0.0)

    def arrives(r):
        """When rank r's next task can start (None: what it waits on is not done)."""
        d, i, c = orders[r][at[r]]
        s = c * pp + r
        if d == "F":
            if not s:
                return 0.0
            key, boundary = ("F", s - 1, i), s - 1
        elif s == last:
            key, boundary = ("F", s, i), None
        else:
            key, boundary = ("B", s + 1, i), s
        if key not in done:
            return None
        end, sent_async = done[key]
        return end + (transfer[boundary] if sent_async and boundary is not None else 0.0)

    while True:
        waiting = []
        for r in range(pp):
            if left[r] is None and at[r] < len(orders[r]):
                start = arrives(r)
                if start is not None and start <= clock + 1e-12:
                    left[r] = 1.0
                elif start is not None:
                    waiting.append(start)
        tasks = {}
        for r in range(pp):
            if left[r] is not None:
                d, _, c = orders[r][at[r]]
                tasks[r] = (c * pp + r, d)
        if not tasks and not waiting:
            if any(a < len(o) for a, o in zip(at, orders)):
                raise RuntimeError("pipeline order deadlocked")  # not reachable for megatron's
            return clock
        rest = {r: other[s][d] + blocking(r, s) for r, (s, d) in tasks.items()}
        f = _factors_at(tasks, work, rest, ranks_per_stage, factor)
        length = {r: work[s][d] * f[r] + rest[r] for r, (s, d) in tasks.items()}
        step = min([left[r] * length[r] for r in tasks] + [t - clock for t in waiting])
        clock += step
        for r, (s, d) in tasks.items():
            left[r] = left[r] - step / length[r] if length[r] > 0 else 0.0
            if left[r] <= 1e-9:
                done[(d, s, orders[r][at[r]][1])] = (clock, overlap and at[r] in steady[r])
                left[r], at[r] = None, at[r] + 1
