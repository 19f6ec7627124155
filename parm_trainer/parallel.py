"""Process groups for MP (tensor), EP, ESP (expert tensor), DP and PP.

megatron-core's parallel_state builds the groups; this module starts torch.distributed, asks it
for them, adds the subgroups and the node relay's groups the MoE layers use, and takes them all
down again. The layout was checked before (planning/checks.py), on every rank and with no
collective.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
from parm_trainer import gloo_device, node_reduce, node_relay




def _attempt_store(timeout: datetime.timedelta) -> dict:
    """Under torchrun, a store of this attempt's own: a restarted job (--max-restarts) meets
    again in the agent's store, where the failed attempt's process-group keys (its ranks'
    addresses) still are, and gloo would connect to the dead ranks. {} elsewhere (env://)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                       is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dict(store=torch.distributed.PrefixStore(f"parm_trainer/attempt_{attempt}", store),
                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def initialize_distributed(args: argparse.Namespace, stages=None) -> None:
    """Start torch.distributed (env:// from torchrun) and build megatron's process groups.
    stages: the pipeline stages' layout string to record where it is not megatron's even split
    (planning/layout.recorded_stages), for the checkpoints."""
    from megatron.core import parallel_state

    if args.distributed_backend == "gloo":
        gloo_device.share_one_device()
    if not torch.distributed.is_initialized():
        if args.distributed_backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
        if "RANK" not in os.environ:  # a plain `python` run: one rank
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
        torch.distributed.init_process_group(args.distributed_backend, timeout=timeout,
                                             **_attempt_store(timeout))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size",
                                                     None),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,  # a timedelta's minutes
    )
    consecutive_subgroup(1)
    consecutive_subgroup(torch.distributed.get_world_size() // args.pipeline_model_parallel_size)
    node_relay.build(args)
    node_reduce.build(args)
    _RECORDED["stages"] = stages


_SUBGROUPS: dict = {}
_RECORDED: dict = {}  # of this run's layout, what the group sizes do not say


def record_stages(stages) -> None:
    """The stages' layout string to record (as initialize_distributed's stages), for a layout
    chosen once the groups exist (the stage builder's measured default path)."""
    _RECORDED["stages"] = stages


def recorded_pipeline_stages():
    """The stages' layout string where it is not megatron's even split (else None): part of the
    layout a checkpoint records, since the distributed optimizer's dp_reshardable state and the
    RNG streams belong to one placement of the layers."""
    return _RECORDED.get("stages")


def rank_device():
    """This rank's device: its GPU under CUDA, else the CPU. Tensors handed to collectives
    live there (NCCL takes device tensors only, gloo on CPU host tensors)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def consecutive_subgroup(size: int):
    """This rank's group of `size` consecutive ranks (size 1: itself; world / PP: its pipeline
    stage, PP being megatron's outermost rank dimension). new_subgroups is collective over the
    world, so initialize_distributed creates the ones the MoE layers use on every rank up front:
    a stage without MoE layers must not leave the others waiting."""
    if size not in _SUBGROUPS:
        _SUBGROUPS[size], _ = torch.distributed.new_subgroups(group_size=size)
    return _SUBGROUPS[size]


def reset_model_parallel() -> None:
    """Forget megatron's groups and the subgroups above AND destroy their process groups, so a
    process can switch layouts (the benchmarks): megatron's destroy_model_parallel only drops
    its references, and every gloo group left behind keeps its threads and sockets, which
    slows everything after it down."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    _SUBGROUPS.clear()
    _RECORDED.clear()
    node_relay.reset()
    node_reduce.reset()
    if torch.distributed.is_initialized():
        world = torch.distributed.group.WORLD
        for group in list(torch.distributed.distributed_c10d._world.pg_map):
            if group is not world:
                torch.distributed.destroy_process_group(group)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    _SUBGROUPS.clear()
    _RECORDED.clear()
    node_relay.reset()
    node_reduce.reset()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
