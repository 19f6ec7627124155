"""This rank's data-parallel replica, the single-process reference on it
(parm_trainer/moe/reference.py), and the comparison of a row's results with it.

Checks (max abs difference to the reference, max over ranks):
  output, input grad   each rank's result gathered over MP to the full [S, B, M] of its replica
                       and compared with the reference on that replica's data
  gate grad            summed over MP where megatron marks it sequence-parallel (as its
                       finalize_model_grads does), then over the data-parallel group; compared
                       with the reference's gradient summed over all replicas
  expert grads         each rank's fc1/fc2 shard, summed over the expert-data-parallel group,
                       against the same slice of the reference's gradient summed over replicas
                       (every element of the full [E, H, M] / [E, M, H] is some rank's slice)
  aux loss             the tracked load_balancing_loss (before the coefficient), summed over
                       the group megatron-core reduces it over, against the replica's reference
Without DDP nothing averages over replicas, so sums are compared with sums.
With a capacity factor the reference counts capacity per gate call as the schedule does
(s1: one call per MP rank; megatron under --sequence-parallel: one per sequence shard).
Each row also reports |got - reference| / |reference| (L2 norms), the measure for --bf16.
"""

from __future__ import annotations

import torch

from parm_trainer.bench.layout import gather_mp, max_over_ranks
from parm_trainer.bench.results import DIFF_KEYS
from parm_trainer.bench.weights import expert_matrices, replica_data


class Replica:
    """This rank's replica data and the reference results on it (cached per gate-call count)."""

    def __init__(self, args, weights, device):
        from megatron.core import parallel_state

        self.args, self.device = args, device
        self.dp_index = parallel_state.get_data_parallel_rank()
        self.mp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.mp_size = args.tensor_model_parallel_size
        x, g = replica_data(args, self.dp_index)
        self.input, self.output_grad = x.to(device), g.to(device)
        self.weights = {k: v.to(device) for k, v in weights.items()}
        self._refs = {}

    def local(self, full, sequence_parallel: bool):
        if not sequence_parallel:
            return full.clone()
        return full.chunk(self.mp_size, dim=0)[self.mp_rank].contiguous()

    def routing_map(self, gate_calls: int):
        """(T, E) bool: the (token, expert) pairs of this replica's tokens, gated in
        gate_calls calls: the reference's, or megatron's routing where the row's flags go
        beyond the reference (features.py; None under forced balancing)."""
        if not self.args.beyond_reference:
            return self.reference(gate_calls)["routing_map"]
        from parm_trainer.bench.features import routing_map

        s, b, m = self.input.shape
        return routing_map(self.args, self.input.reshape(s * b, m), self.weights["gate"],
                           gate_calls)

    def reference(self, gate_calls: int, aux: bool = True):
        """Reference output, input grad and raw aux on this replica; weight grads summed over
        all replicas (an all-reduce over the DP group: every rank must ask for the same keys in
        the same order)."""
        from megatron.core import parallel_state

        from parm_trainer.moe.reference import moe_reference

        args = self.args
        if args.moe_expert_capacity_factor is None:
            gate_calls = 1
        coeff = args.moe_aux_loss_coeff if aux else 0.0
        if (gate_calls, coeff) not in self._refs:
            s, b, m = self.input.shape
            x = self.input.reshape(s * b, m).clone().requires_grad_()
            w = {k: v.clone().requires_grad_() for k, v in self.weights.items()}
            ref = moe_reference(x, w["gate"], w["fc1"], w["fc2"], args.moe_router_topk,
                                aux_loss_coeff=coeff,
                                capacity_factor=args.moe_expert_capacity_factor,
                                gate_calls=gate_calls, pre_softmax=args.moe_router_pre_softmax)
            objective = (ref.output * self.output_grad.reshape(s * b, m)).sum()
            if coeff:
                objective = objective + ref.aux_loss
            objective.backward()
            grads = {k: v.grad.detach().clone() for k, v in w.items()}
            dp_group = parallel_state.get_data_parallel_group()
            for k in ("gate", "fc1", "fc2"):
                torch.distributed.all_reduce(grads[k], group=dp_group)
            self._refs[(gate_calls, coeff)] = {
                "output": ref.output.detach().view(s, b, m),
                "input_grad": x.grad.detach().view(s, b, m),
                "aux_loss": ref.raw_aux_loss.detach(),
                "routing_map": ref.routing_map.cpu(),
                **{f"{k}_grad_total": v for k, v in grads.items()},
            }
        return self._refs[(gate_calls, coeff)]


def gate_calls(name, args):
    """How many gate calls the schedule makes on a replica's tokens (capacity is per call)."""
    if name == "s1":
        return args.tensor_model_parallel_size
    if name == "megatron" and args.sequence_parallel:
        return args.tensor_model_parallel_size
    return 1


def tracked_aux(device):
    """The tracked load_balancing_loss of layer 1, summed over its reduce group; None if the
    layer tracked none."""
    from megatron.core.transformer.moe import moe_utils

    entry = moe_utils.get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    if entry is None:
        return None
    value = entry["values"][0].detach().clone().to(device)
    if entry.get("reduce_group") is not None:
        torch.distributed.all_reduce(value, group=entry["reduce_group"])
    return value


def clear_tracker():
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.pop("load_balancing_loss", None)


def rel_l2(got, want) -> float:
    norm = want.norm().item()
    return (got - want).norm().item() / norm if norm else (got - want).norm().item()


def output_diffs(full_out, full_in_grad, ref):
    """This rank's max abs differences of output and input grad (full replica tensors) to the
    reference, and the reference's largest values."""
    diffs = {"output": (full_out - ref["output"]).abs().max().item(),
             "input_grad": (full_in_grad - ref["input_grad"]).abs().max().item()}
    scale = {"output": ref["output"].abs().max().item(),
             "input_grad": ref["input_grad"].abs().max().item()}
    return diffs, scale


def _weight_grads(layer, shards, ref, diffs, scale, rel):
    """The gate grad and this rank's expert shards' grads against the reference's totals."""
    from megatron.core import parallel_state

    gate_grad = layer.router.weight.grad.detach().to(torch.float32, copy=True)
    if getattr(layer.router.weight, "sequence_parallel", False):
        torch.distributed.all_reduce(gate_grad,
                                     group=parallel_state.get_tensor_model_parallel_group())
    torch.distributed.all_reduce(gate_grad, group=parallel_state.get_data_parallel_group())
    diffs["gate_grad"] = (gate_grad - ref["gate_grad_total"]).abs().max().item()
    scale["gate_grad"] = ref["gate_grad_total"].abs().max().item()
    rel["gate_grad"] = rel_l2(gate_grad, ref["gate_grad_total"])

    edp = parallel_state.get_expert_data_parallel_group()
    worst, biggest, rel["expert_grad"] = 0.0, 0.0, 0.0
    for (fc1, fc2), (e, rows) in zip(expert_matrices(layer.experts, grads=True), shards):
        for grad, want in ((fc1, ref["fc1_grad_total"][e, rows, :]),
                           (fc2, ref["fc2_grad_total"][e, :, rows])):
            grad = grad.detach().to(torch.float32, copy=True)
            torch.distributed.all_reduce(grad, group=edp)
            worst = max(worst, (grad - want).abs().max().item())
            biggest = max(biggest, want.abs().max().item())
            rel["expert_grad"] = max(rel["expert_grad"], rel_l2(grad, want))
    diffs["expert_grad"], scale["expert_grad"] = worst, biggest


def compare_layer(layer, shards, x, out, aux, ref, args):
    """A megatron-style layer's (Parm's or megatron-core's) iteration against the reference:
    (max abs diffs, reference scales, relative L2 diffs, full output, full input grad), the
    diffs max over ranks."""
    sp = args.sequence_parallel
    full_out = gather_mp(out.detach(), sp).float()
    full_in_grad = gather_mp(x.grad.detach(), sp).float()
    diffs, scale = output_diffs(full_out, full_in_grad, ref)
    rel = {"output": rel_l2(full_out, ref["output"]),
           "input_grad": rel_l2(full_in_grad, ref["input_grad"])}
    _weight_grads(layer, shards, ref, diffs, scale, rel)
    if args.moe_aux_loss_coeff:
        diffs["aux_loss"] = float("inf") if aux is None else (aux - ref["aux_loss"]).abs().item()
        scale["aux_loss"] = ref["aux_loss"].abs().item()
    else:
        diffs["aux_loss"] = scale["aux_loss"] = None
    for key in DIFF_KEYS:
        if diffs[key] is not None:
            diffs[key] = max_over_ranks(diffs[key])
    rel = {key: max_over_ranks(value) for key, value in rel.items()}
    return diffs, scale, rel, full_out, full_in_grad
