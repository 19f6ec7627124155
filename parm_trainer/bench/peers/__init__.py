"""The peers of Parm's schedules in the benchmark: megatron-core's own MoE layer with one of its
token dispatchers (megatron.py) and DeepSpeed's MoE layer in its three modes (deepspeed.py,
DeepSpeed imported only when one of its rows runs).

    expand(["megatron-alltoall", "deepspeed"])  # -> the rows: ..., deepspeed-ep, -dedup, -ted
"""

from __future__ import annotations

MEGATRON = ("megatron", "megatron-alltoall", "megatron-allgather")
DEEPSPEED_MODES = ("ep", "dedup", "ted")
DEEPSPEED = tuple(f"deepspeed-{mode}" for mode in DEEPSPEED_MODES)
NAMES = (*MEGATRON, *DEEPSPEED)
GROUPS = {"deepspeed": DEEPSPEED}  # one name for several rows


class PeerCannotRun(Exception):
    """This peer cannot run this layout (or is not installed); the message says why."""


def expand(names) -> list:
    """Row names with the group names replaced by their rows, each row once, in order."""
    out = []
    for name in names:
        for row in GROUPS.get(name, (name,)):
            if row not in out:
                out.append(row)
    return out


def deepspeed_mode(name: str):
    """"ted" for the row "deepspeed-ted"; None for a row that is not DeepSpeed's."""
    return name.split("-", 1)[1] if name in DEEPSPEED else None


def megatron_dispatcher(name: str):
    """"alltoall" for "megatron-alltoall"; None for plain "megatron" (its dispatcher comes from
    --moe-token-dispatcher-type) and for the other rows."""
    return name.split("-", 1)[1] if name in MEGATRON[1:] else None
