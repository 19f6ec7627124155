"""Two gloo ranks (torchrun): megatron-core's uneven gathers and the dispatcher's all_to_all,
unpatched and patched; each rank writes rank<r>.json into argv[1]
(tests/test_compat_cpu_collectives.py)."""
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.moe import moe_utils
from parm_trainer.compat import cpu

SIZES = [3, 5]          # uneven first-dim pieces: rank 0 holds 3 rows, rank 1 holds 5
A2A = [[1, 2], [3, 1]]  # A2A[src][dst]: rows rank src sends to rank dst


def piece(r):
    return torch.arange(SIZES[r] * 2, dtype=torch.float).view(-1, 2) + 100 * (r + 1)


def full(r):
    return torch.arange(sum(SIZES) * 2, dtype=torch.float).view(-1, 2) * (r + 1) + r


def a2a_input(r):
    return torch.cat([torch.full((n, 2), 10.0 * r + dst) for dst, n in enumerate(A2A[r])])


def outcome(fn, reference):
    try:
        result = fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "equal" if torch.equal(result, reference) else f"different: {result.tolist()}"


dist.init_process_group("gloo")
group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
start = sum(SIZES[:rank])
gather_ref = torch.cat([piece(r) for r in range(world)])
scatter_ref = sum(full(r) for r in range(world))[start:start + SIZES[rank]]
a2a_ref = torch.cat([a2a_input(src).split(A2A[src])[rank] for src in range(world)])
out_splits = [A2A[src][rank] for src in range(world)]

original_gather = mappings._gather_along_first_dim
original_scatter = mappings._reduce_scatter_along_first_dim
original_move = moe_utils.maybe_move_tensor_to_cpu
cpu.patch_cuda_device_streams_events()  # the original paths need torch.cuda.current_device()
result = {
    "unpatched_gather": outcome(
        lambda: original_gather(piece(rank), group, output_split_sizes=SIZES), gather_ref),
    "unpatched_scatter": outcome(
        lambda: original_scatter(full(rank), group, input_split_sizes=SIZES), scatter_ref),
    "unpatched_all_to_all": outcome(lambda: mappings.all_to_all(
        group, a2a_input(rank),
        original_move(torch.tensor(out_splits), as_numpy=True),
        original_move(torch.tensor(A2A[rank]), as_numpy=True)), a2a_ref),
}

result["applied"] = cpu.apply()
result["gather"] = outcome(
    lambda: mappings._gather_along_first_dim(piece(rank), group, output_split_sizes=SIZES),
    gather_ref)
result["scatter"] = outcome(
    lambda: mappings._reduce_scatter_along_first_dim(full(rank), group, input_split_sizes=SIZES),
    scatter_ref)
result["gather_even"] = outcome(
    lambda: mappings._gather_along_first_dim(full(rank), group),
    torch.cat([full(r) for r in range(world)]))
result["scatter_even"] = outcome(
    lambda: mappings._reduce_scatter_along_first_dim(full(rank)[:4], group),
    sum(full(r)[:4] for r in range(world))[2 * rank:2 * rank + 2])
result["all_to_all"] = outcome(lambda: mappings.all_to_all(
    group, a2a_input(rank),
    moe_utils.maybe_move_tensor_to_cpu(torch.tensor(out_splits), as_numpy=True),
    moe_utils.maybe_move_tensor_to_cpu(torch.tensor(A2A[rank]), as_numpy=True)), a2a_ref)

# The MoE path: gather with uneven sizes forward, reduce-scatter of the gradient backward.
x = piece(rank).requires_grad_()
weight = torch.arange(sum(SIZES) * 2, dtype=torch.float).view(-1, 2)
y = mappings.gather_from_sequence_parallel_region(x, group=group, output_split_sizes=SIZES)
(y * weight).sum().backward()
result["sequence_parallel_forward"] = (
    "equal" if torch.equal(y.detach(), gather_ref) else f"different: {y.tolist()}")
result["sequence_parallel_backward"] = (
    "equal" if torch.equal(x.grad, world * weight[start:start + SIZES[rank]]) else
    f"different: {x.grad.tolist()}")

with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
