"""A schedule is data: an ordered list of steps, each naming what it does and on which group.

The executor (layer.py) runs the steps; the byte accounting is recorded by the collectives the
steps call (comm.py); a cost model can price the same steps. Step ops:

    gate            top-k routing on the tokens this rank holds ("mp": they are split over MP)
    dispatch        tokens (n, M) -> (E, C, M), C the capacity of one gate call
    combine         (E, C, M) -> (n, M), weighted by the routing probabilities
    expert          this rank's expert shards on (E, c, M), partial sums over ESP
    split_tokens    keep this MP rank's 1/G of the tokens (no communication)
    gather_tokens   MP-AllGather of tokens, used identically by every MP rank afterwards
    split_capacity  keep this MP rank's 1/G of the capacity slots (no communication)
    a2a             AlltoAll over EP (blocks of experts)
    allreduce       ESP-AllReduce
    copy            identity; backward, ESP-AllReduce of the gradient (replicated expert input)
    exchange        the expert exchange: AlltoAll (EP), ESP-AllGather, expert, ESP-ReduceScatter,
                    AlltoAll back (and, with group "ep,esp,mp", the MP-AllGather of the
                    capacity, used identically afterwards) in r pieces of the capacity slots
                    (r = the layer's `chunks` pieces; of the tokens, in exact counts, in the exact
                    exchange of exchange.py), the AlltoAlls of later pieces on the wire while
                    earlier pieces compute; r = 1 is each collective after the other
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional


class Op(StrEnum):
    """A plan step's op: what the executor (layer.py) runs and the cost model prices."""
    GATE = "gate"
    DISPATCH = "dispatch"
    COMBINE = "combine"
    EXPERT = "expert"
    SPLIT_TOKENS = "split_tokens"
    GATHER_TOKENS = "gather_tokens"
    SPLIT_CAPACITY = "split_capacity"
    A2A = "a2a"
    ALLREDUCE = "allreduce"
    COPY = "copy"
    EXCHANGE = "exchange"


@dataclass(frozen=True)
class Step:
    op: Op
    group: Optional[str] = None  # "mp", "ep", "esp", or the exchange's "ep,esp[,mp]"

    def __post_init__(self):
        object.__setattr__(self, "op", Op(self.op))  # an unknown op fails here

    def __str__(self) -> str:
        return f"{self.op}[{self.group}]" if self.group else self.op


@dataclass(frozen=True)
class Plan:
    name: str
    steps: tuple
    splits_tokens: bool    # the gate runs on 1/G of the tokens (gate grads summed over MP)
    splits_capacity: bool  # the capacity dimension is split over MP (C must divide by G)

    def __str__(self) -> str:
        return f"{self.name}: " + " -> ".join(map(str, self.steps))
