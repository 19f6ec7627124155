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
          slots, AlltoAll (EP), ESP-AllGather, expert, ESP-ReduceScatter, then the AlltoAll back
          pipelined with the MP-AllGather of the dispatched layout (Parm's unified collective),
          and the combine on all N tokens.

With chunks r > 1, s1's and s2's exchange (AlltoAll, ESP-AllGather, expert, ESP-ReduceScatter,
AlltoAll back, and s2's MP-AllGather) becomes one "pipeline" step over r chunks of the capacity
slots: every chunk's AlltoAll is issued at once, and while chunk i+1's are on the wire chunk i
is gathered, computed and sent back (layer.py). The baseline is never pipelined (DeepSpeed's
TED is not).
"""

from __future__ import annotations

from parm_trainer.moe.plan import Plan, Step

SCHEDULES = ("baseline", "s1", "s2")


def baseline(sequence_parallel: bool, chunks: int = 1) -> Plan:
    steps = [Step("gate"), Step("dispatch"), Step("a2a", "ep"), Step("copy", "esp"),
             Step("expert"), Step("allreduce", "esp"), Step("a2a", "ep"), Step("combine")]
    if sequence_parallel:
        steps = [Step("gather_tokens", "mp"), *steps, Step("split_tokens", "mp")]
    return Plan("baseline", tuple(steps), splits_tokens=False, splits_capacity=False)


def s1(sequence_parallel: bool, chunks: int = 1) -> Plan:
    exchange = ([Step("pipeline", "ep,esp")] if chunks > 1 else
                [Step("a2a+allgather", "ep,esp"), Step("expert"), Step("reducescatter+a2a", "esp,ep")])
    steps = [Step("gate", "mp"), Step("dispatch"), *exchange, Step("combine")]
    if not sequence_parallel:
        steps = [Step("split_tokens", "mp"), *steps, Step("gather_tokens", "mp")]
    return Plan("s1", tuple(steps), splits_tokens=True, splits_capacity=False)


def s2(sequence_parallel: bool, chunks: int = 1) -> Plan:
    exchange = ([Step("pipeline", "ep,esp,mp")] if chunks > 1 else
                [Step("a2a+allgather", "ep,esp"), Step("expert"), Step("reducescatter", "esp"),
                 Step("a2a+gather_capacity", "ep,mp")])
    steps = [Step("gate"), Step("dispatch"), Step("split_capacity", "mp"), *exchange,
             Step("combine")]
    if sequence_parallel:
        steps = [Step("gather_tokens", "mp"), *steps, Step("split_tokens", "mp")]
    return Plan("s2", tuple(steps), splits_tokens=False, splits_capacity=True)


def build_plan(name: str, sequence_parallel: bool, chunks: int = 1) -> Plan:
    """The plan of schedule `name`; chunks > 1 pipelines s1's and s2's expert exchange."""
    try:
        return {"baseline": baseline, "s1": s1, "s2": s2}[name](sequence_parallel, chunks)
    except KeyError:
        raise ValueError(f"--moe-parm-schedule {name!r}: choose one of {SCHEDULES}") from None
