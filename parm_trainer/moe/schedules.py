"""Parm's schedules (PARM.md), side by side. `sequence_parallel`: tokens enter the MoE layer
already split over MP (1/G each) and leave split the same way.

baseline  DeepSpeed-MoE with expert tensor parallelism: every MP rank holds all N tokens
          (gathered first under sequence parallelism), gates them, sends them over EP, and the
          expert shards' partial outputs are all-reduced over ESP (and, backward, the gradient of
          the replicated expert input, as the column-parallel fc1 leaves it partial). Needs ESP = MP,
          as DeepSpeed's TED does: otherwise the same tokens reach the same shard twice.
s1        MP paused before the gate: each MP rank gates its 1/G of the tokens, AlltoAll (EP) of
          D/G, ESP-AllGather, expert, ESP-ReduceScatter, AlltoAll back, combine, MP-AllGather of
          the output (skipped under sequence parallelism, where the split is already the layout).
s2        MP paused after the gate: every MP rank gates all N tokens, keeps 1/G of the capacity
          slots, AlltoAll (EP), ESP-AllGather, expert, ESP-ReduceScatter, AlltoAll back, each
          piece followed by the MP-AllGather of the dispatched layout (Parm's unified
          collective), and the combine on all N tokens.

s1's and s2's expert exchange (AlltoAll, ESP-AllGather, expert, ESP-ReduceScatter, AlltoAll
back, and s2's MP-AllGather) is one "exchange" step over r = chunks pieces of the capacity
slots: every piece's AlltoAll is issued at once, and while piece i+1's are on the wire piece i
is gathered, computed and sent back (layer.py); r = 1 runs the exchange in one piece, each
collective after the other. The baseline is never pipelined (DeepSpeed's TED is not).
"""

from __future__ import annotations

from parm_trainer.moe.plan import Op, Plan, Step

SCHEDULES = ("baseline", "s1", "s2")


def baseline(sequence_parallel: bool) -> Plan:
    steps = [Step(Op.GATE), Step(Op.DISPATCH), Step(Op.A2A, "ep"), Step(Op.COPY, "esp"),
             Step(Op.EXPERT), Step(Op.ALLREDUCE, "esp"), Step(Op.A2A, "ep"), Step(Op.COMBINE)]
    if sequence_parallel:
        steps = [Step(Op.GATHER_TOKENS, "mp"), *steps, Step(Op.SPLIT_TOKENS, "mp")]
    return Plan("baseline", tuple(steps), splits_tokens=False, splits_capacity=False)


def s1(sequence_parallel: bool) -> Plan:
    steps = [Step(Op.GATE, "mp"), Step(Op.DISPATCH), Step(Op.EXCHANGE, "ep,esp"), Step(Op.COMBINE)]
    if not sequence_parallel:
        steps = [Step(Op.SPLIT_TOKENS, "mp"), *steps, Step(Op.GATHER_TOKENS, "mp")]
    return Plan("s1", tuple(steps), splits_tokens=True, splits_capacity=False)


def s2(sequence_parallel: bool) -> Plan:
    steps = [Step(Op.GATE), Step(Op.DISPATCH), Step(Op.SPLIT_CAPACITY, "mp"),
             Step(Op.EXCHANGE, "ep,esp,mp"), Step(Op.COMBINE)]
    if sequence_parallel:
        steps = [Step(Op.GATHER_TOKENS, "mp"), *steps, Step(Op.SPLIT_TOKENS, "mp")]
    return Plan("s2", tuple(steps), splits_tokens=False, splits_capacity=True)


def build_plan(name: str, sequence_parallel: bool) -> Plan:
    """The plan of schedule `name` (the pieces of its exchange are the layer's --moe-parm-chunks,
    the same plan for every count)."""
    try:
        return {"baseline": baseline, "s1": s1, "s2": s2}[name](sequence_parallel)
    except KeyError:
        raise ValueError(f"--moe-parm-schedule {name!r}: choose one of {SCHEDULES}") from None
