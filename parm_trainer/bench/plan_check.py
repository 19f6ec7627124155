"""The planner (parm_trainer/planning/search.py) against measurement: which of its ranked
layouts tools/bench_plan.py runs, and how well its ranking agrees with the runs.

    chosen = pick(ranked, top=12, others=4)       # indices into the ranked list
    rho = spearman(predicted, measured)
    ceiling = run_agreement(runs)                  # the bench against itself
"""

from __future__ import annotations

import itertools
import statistics


def pick(count: int, top: int, others: int) -> list:
    """Indices of the first `top` of `count` ranked layouts and `others` more spread evenly
    over the rest (the last one included), in rank order."""
    first = list(range(min(top, count)))
    rest = list(range(len(first), count))
    if not rest or others < 1:
        return first
    if others >= len(rest):
        return first + rest
    step = (len(rest) - 1) / max(1, others - 1)
    spread = sorted({rest[round(i * step)] for i in range(others)})
    return first + spread


def _ranks(values: list) -> list:
    """Ranks (1 = smallest), ties given their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list, b: list) -> float:
    """Spearman's rank correlation of two equally long lists."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("spearman needs two lists of the same length, at least 2")
    ra, rb = _ranks(a), _ranks(b)
    mean = (len(a) + 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    var_a = sum((x - mean) ** 2 for x in ra)
    var_b = sum((y - mean) ** 2 for y in rb)
    return cov / (var_a * var_b) ** 0.5


def run_agreement(runs: list) -> float:
    """How well the bench agrees with itself: the median, over every pair of repeats (run r
    of each layout against run s), of the Spearman correlation of their measured times; runs
    holds one list of repeats per layout. The rank correlation a perfect cost model could
    reach on these measurements is of this order. None with fewer than 2 repeats."""
    repeats = min(len(r) for r in runs)
    if repeats < 2:
        return None
    return statistics.median(spearman([r[i] for r in runs], [r[j] for r in runs])
                             for i, j in itertools.combinations(range(repeats), 2))
