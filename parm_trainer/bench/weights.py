"""The benchmark's weights and data, the same for every row, and each rank's slice of them.

Weights are drawn in full on every rank from --seed (gate [E, M] and fc1 [E, H, M] with std
--init-method-std, fc2 [E, M, H] with std / sqrt(2 * --num-layers)) and each rank keeps its
EP/ESP slice. Each data-parallel replica d draws its own full input [S, B, M] and output
gradient from (--seed, d); a rank feeds its slice (the sequence shard of its MP rank under
--sequence-parallel, else all of it).

--dump DIR (DP replica 0): input.pt and output_grad.pt ([S*B, M], sequence-major, i.e.
[S, B, M].reshape), input_dp<d>.pt (every replica's input), weights.pt (gate, fc1, fc2,
activation, router) and <schedule>_output.pt / <schedule>_input_grad.pt (full, same order).
"""

from __future__ import annotations

import math
import os

import torch

from parm_trainer.moe.reference import ACTIVATION, ROUTER, ROUTER_PRE_SOFTMAX


def _generator(*key) -> torch.Generator:
    seed = 0
    for part in key:
        seed = (seed * 1_000_003 + int(part)) % (2 ** 62)
    return torch.Generator().manual_seed(seed)


def full_weights(args):
    """gate [E, M], fc1 [E, H, M], fc2 [E, M, H], the same on every rank."""
    e, m, h = args.num_experts, args.hidden_size, args.moe_ffn_hidden_size
    std = args.init_method_std
    gen = _generator(args.seed, 1)
    gate = torch.empty(e, m).normal_(0.0, std, generator=gen)
    fc1 = torch.empty(e, h, m).normal_(0.0, std, generator=gen)
    fc2 = torch.empty(e, m, h).normal_(0.0, std / math.sqrt(2.0 * args.num_layers), generator=gen)
    return {k: _as_layer_sees(v, args) for k, v in (("gate", gate), ("fc1", fc1), ("fc2", fc2))}


def _as_layer_sees(t, args):
    """With --bf16 the layer holds bf16 values: the fp32 reference gets the same values, so
    the difference measures the bf16 computation, not the rounding of its inputs."""
    return t.bfloat16().float() if args.bf16 else t


def replica_data(args, dp_index: int):
    """Full input and output gradient [S, B, M] of data-parallel replica dp_index."""
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    gen = _generator(args.seed, 2, dp_index)
    return (_as_layer_sees(torch.randn(shape, generator=gen), args),
            _as_layer_sees(torch.randn(shape, generator=gen), args))


def expert_matrices(experts, grads: bool = False):
    """[(fc1, fc2)] of each local expert as SequentialMLP holds them, (H', M) and (M, H'):
    views of the parameters (of their gradients with grads=True), whichever module megatron
    built: SequentialMLP, GroupedMLP (--moe-grouped-gemm: weight1 [M, n H'] read as n blocks
    [M, H'], weight2 as n blocks [H', M]) or Transformer Engine's TEGroupedMLP (weight<i>)."""
    def of(param):
        return param.grad if grads else param

    if hasattr(experts, "local_experts"):
        return [(of(e.linear_fc1.weight), of(e.linear_fc2.weight))
                for e in experts.local_experts]
    n = experts.num_local_experts
    if hasattr(experts, "weight1"):
        m = experts.config.hidden_size
        fc1, fc2 = of(experts.weight1).view(n, m, -1), of(experts.weight2).view(n, -1, m)
        return [(fc1[i].t(), fc2[i].t()) for i in range(n)]
    return [(of(getattr(experts.linear_fc1, f"weight{i}")),
             of(getattr(experts.linear_fc2, f"weight{i}"))) for i in range(n)]


def load_weights(layer, weights, args):
    """Copy this rank's EP/ESP slices of the full weights into a megatron-style layer (router,
    experts); returns [(expert, fc1 rows)] of its shards."""
    from megatron.core import parallel_state

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    esp_rank = parallel_state.get_expert_tensor_parallel_rank()
    esp = args.expert_tensor_parallel_size
    local = args.num_experts // args.expert_model_parallel_size
    h = args.moe_ffn_hidden_size // esp
    rows = slice(esp_rank * h, (esp_rank + 1) * h)
    matrices = expert_matrices(layer.experts)
    with torch.no_grad():
        layer.router.weight.copy_(weights["gate"])
        for i, (fc1, fc2) in enumerate(matrices):
            e = ep_rank * local + i
            fc1.copy_(weights["fc1"][e, rows, :])
            fc2.copy_(weights["fc2"][e, :, rows])
    return [(ep_rank * local + i, rows) for i in range(len(matrices))]


def router_name(args) -> str:
    return ROUTER_PRE_SOFTMAX if args.moe_router_pre_softmax else ROUTER


def dump_inputs(dump_dir, args, replica, weights) -> None:
    """--dump: replica 0's input and output gradient, every replica's input, the weights."""
    if not dump_dir or torch.distributed.get_rank() != 0:
        return
    os.makedirs(dump_dir, exist_ok=True)
    s, b, m = replica.input.shape
    torch.save(replica.input.reshape(s * b, m).cpu(), os.path.join(dump_dir, "input.pt"))
    torch.save(replica.output_grad.reshape(s * b, m).cpu(),
               os.path.join(dump_dir, "output_grad.pt"))
    torch.save({**weights, "activation": ACTIVATION, "router": router_name(args)},
               os.path.join(dump_dir, "weights.pt"))
    dp = torch.distributed.get_world_size() // args.tensor_model_parallel_size
    for d in range(dp):  # every replica's input, for checks that need all ranks' tokens
        torch.save(replica_data(args, d)[0].reshape(s * b, m),
                   os.path.join(dump_dir, f"input_dp{d}.pt"))


def dump_result(dump_dir, name, full_out, full_in_grad):
    """--dump: NAME_output.pt and NAME_input_grad.pt of data-parallel replica 0, as (T, M);
    a row s1/r2 is written as s1-r2_output.pt."""
    if dump_dir and torch.distributed.get_rank() == 0:
        name = name.replace("/", "-")
        s, b, m = full_out.shape
        torch.save(full_out.reshape(s * b, m).cpu(), os.path.join(dump_dir, f"{name}_output.pt"))
        torch.save(full_in_grad.reshape(s * b, m).cpu(),
                   os.path.join(dump_dir, f"{name}_input_grad.pt"))
