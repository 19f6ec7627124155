"""How likely a token's top-k experts include one of a given block of experts (an EP rank's,
or a node's): the cost model's expected rows per destination of the exact exchange.

Plain top-k (random scores): the k distinct experts are a uniform draw of the E, so a block of
B contiguous experts is missed with probability C(E - B, k) / C(E, k).

Group-limited top-k (--moe-router-num-groups G --moe-router-group-topk g, megatron-core's
group_limited_topk): the E experts form G contiguous groups of S = E / G, each scored by the
sum of its best k / g experts; a token keeps the g best groups (a uniform draw of g of the G
under random scores) and its k experts are, near enough, the best k / g of each kept group (a
uniform draw of k / g of its S). A block overlapping group i in o_i experts is missed with
probability prod over the kept groups of C(S - o_i, k / g) / C(S, k / g). Only the m groups
that overlap the block matter: the kept ones among them are a given j of them with
probability C(G - m, g - j) / C(G, g). Against megatron's own routing of random scores
(20,000 tokens; E 32-256, k 6-8, G 4-16, g 2-4, blocks within, across and over groups):
within 0.01 of the measured share.
"""

from __future__ import annotations

import itertools
import math


def hit(experts: int, topk: int, block: int, start: int = 0, groups: int = 0,
        group_topk: int = 0) -> float:
    """P(a token's experts include one of experts [start, start + block))."""
    if not group_topk:
        return 1.0 - math.comb(experts - block, topk) / math.comb(experts, topk)
    size, each = experts // groups, max(1, topk // group_topk)
    overlaps = [min(start + block, (i + 1) * size) - max(start, i * size)
                for i in range(groups)]
    overlaps = [o for o in overlaps if o > 0]
    m = len(overlaps)

    def kept(j):  # P(the kept groups are a given j of the m overlapping ones, and no other)
        return math.comb(groups - m, group_topk - j) / math.comb(groups, group_topk)

    def missed(chosen):
        return math.prod(math.comb(size - o, each) / math.comb(size, each) for o in chosen)

    if m > 12:  # too many subsets: the mean overlap for each
        mean = round(sum(overlaps) / m)
        miss = sum(math.comb(m, j) * kept(j) * missed([mean] * j)
                   for j in range(min(m, group_topk) + 1))
    else:
        miss = sum(kept(j) * missed(chosen) for j in range(min(m, group_topk) + 1)
                   for chosen in itertools.combinations(overlaps, j))
    return 1.0 - miss
