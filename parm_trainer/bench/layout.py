"""The layout a benchmark row runs on: torch.distributed started once, megatron's process
groups (re)built for each layout (MP, EP, ESP, PP) the rows ask for, the device, the
collectives the checks use, which node a rank is on, and leaving without the slow teardown.

    set_layout(args)         # before building a layer of args' layout
    leave(status)            # the process's end, once rank 0 has written its files
"""

from __future__ import annotations

import torch

from parm_trainer import process_exit
from parm_trainer.parallel import rank_device

_CURRENT_LAYOUT = [None]


def device():
    return torch.device(rank_device())


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _layout_key(args):
    """What the process groups depend on: the sizes, and where the exact exchange relays
    through nodes (node_relay.build makes its groups with the others)."""
    from parm_trainer import node_relay

    per_node = node_relay.ranks_per_node(args)
    return (args.tensor_model_parallel_size, args.expert_model_parallel_size,
            args.expert_tensor_parallel_size, args.pipeline_model_parallel_size, per_node,
            node_relay.relay_size(args, per_node))


def set_layout(args) -> None:
    """Start torch.distributed on first use; (re)build megatron's groups for args' layout."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from parm_trainer.parallel import initialize_distributed, reset_model_parallel

    key = _layout_key(args)
    if _CURRENT_LAYOUT[0] != key:
        if parallel_state.model_parallel_is_initialized():
            reset_model_parallel()
        initialize_distributed(args)
        _CURRENT_LAYOUT[0] = key
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)


def ensure_distributed(args) -> None:
    """torch.distributed started even when no row ran (every one skipped before any layout)."""
    if not torch.distributed.is_initialized():
        from parm_trainer.parallel import initialize_distributed

        initialize_distributed(args)


def gather_mp(local, sequence_parallel):
    """This rank's sequence shard gathered over MP to the replica's full [S, B, M] (under
    sequence parallelism; else every MP rank holds it all already)."""
    from megatron.core import parallel_state

    if not sequence_parallel or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return local
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=0)


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


def leave(status: int) -> None:
    """End the process now: every rank is past the final barrier and rank 0's files are
    written, so skip the interpreter's teardown of megatron's (and DeepSpeed's) many process
    groups (seconds on a CPU)."""
    process_exit.now(status)
