"""A rank's local experts as two grouped GEMMs on CPU, with megatron's expert weights.

megatron-core's SequentialMLP runs its experts one after the other: per expert an fc1 and an
fc2 call, each an autograd node, and three more GEMMs in the backward. With fine-grained
experts (64 of them with ~128 rows each) those small calls and their nodes are most of the
layer's time on CPU. torch._grouped_mm takes all experts' rows in one call (rows grouped by
expert, `offs` the cumulative counts), forward and backward alike; here the experts are one
autograd node. The weights stay the SequentialMLP's own tensors (checkpoints, the optimizer
and the gradient buffers see nothing new); they are stacked for each call and not kept for
the backward, which stacks them again.

    h  = x @ fc1[e].T              (rows of expert e)      fc1: (F1, M), F1 = 2F under SwiGLU
    a  = act(h)                    gelu, or silu(h[:, :F]) * h[:, F:]
    y  = (a * p) @ fc2[e].T        fc2: (M, F); p: the rows' routing probabilities

the function megatron's MLP computes with per_token_scale p and no biases (ESP shards: fc1
holds F1/ESP rows, fc2 F/ESP columns; y is then the partial sum the schedule reduces).
Used where it computes exactly that: on CPU, SequentialMLP experts without biases, gelu or
SwiGLU, probabilities applied after the activation (not moe_apply_probs_on_input); elsewhere
(GPUs: megatron's grouped and Transformer Engine experts) the experts module runs itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def applies(experts, config, x) -> bool:
    """Whether the grouped path computes what `experts` would for rows like x."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    if x.device.type != "cpu" or not hasattr(torch, "_grouped_mm"):
        return False
    if not isinstance(experts, SequentialMLP) or config.add_bias_linear:
        return False
    if config.moe_apply_probs_on_input or config.fp8 or getattr(config, "fp4", None):
        return False
    if getattr(config, "activation_func_clamp_value", None) is not None:
        return False
    if getattr(config, "glu_linear_offset", 0.0) != 0.0:
        return False
    glu = config.gated_linear_unit
    if (config.activation_func, glu) not in ((F.gelu, False), (F.silu, True)):
        return False
    width = experts.local_experts[0].linear_fc2.weight.shape[1]  # F (/ ESP)
    return _dtype_fits(x.dtype, x.shape[1], width)


def _dtype_fits(dtype, hidden: int, width: int) -> bool:
    """fp32, or 16-bit operands whose rows are whole multiples of 16 bytes (as
    torch._grouped_mm needs of every stride)."""
    if dtype == torch.float32:
        return True
    return dtype in (torch.bfloat16, torch.float16) and hidden % 8 == 0 and width % 8 == 0


def applies_to_run(args) -> bool:
    """Whether a run with these arguments computes its experts here (the memory estimate
    counts what it keeps): on CPU, without biases, in a dtype and widths it takes."""
    if torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        return False
    dtype = (torch.bfloat16 if getattr(args, "bf16", False) else
             torch.float16 if getattr(args, "fp16", False) else torch.float32)
    width = args.moe_ffn_hidden_size // args.expert_tensor_parallel_size
    return bool(args.disable_bias_linear) and _dtype_fits(dtype, args.hidden_size, width)


def _act(h, glu: bool):
    if not glu:
        return F.gelu(h)
    gate, linear = torch.chunk(h, 2, dim=-1)
    return F.silu(gate) * linear


def _act_backward(grad, h, glu: bool):
    """The gradient of _act at h."""
    if not glu:
        return torch.ops.aten.gelu_backward(grad, h)
    gate, linear = torch.chunk(h, 2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(grad * linear, gate),
                      grad * F.silu(gate)], dim=-1)


class _Grouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, offs, glu, n, *weights):
        fc1, fc2 = torch.stack(weights[:n]), torch.stack(weights[n:])  # (E, F1, M), (E, M, F)
        h = torch._grouped_mm(x, fc1.transpose(1, 2), offs=offs)
        a = _act(h, glu)
        scaled = (a * probs.unsqueeze(-1)).to(x.dtype)  # as megatron's MLP rounds it
        y = torch._grouped_mm(scaled, fc2.transpose(1, 2), offs=offs)
        # what megatron's expert MLPs keep: fc1's input, the activation's input and output,
        # fc2's input (the stacked weights are stacked again in the backward)
        ctx.save_for_backward(x, probs, offs, h, a, scaled, *weights)
        ctx.glu, ctx.n = glu, n
        return y

    @staticmethod
    def backward(ctx, grad):
        x, probs, offs, h, a, scaled, *weights = ctx.saved_tensors
        n = ctx.n
        fc1, fc2 = torch.stack(weights[:n]), torch.stack(weights[n:])
        grad = grad.contiguous()
        grad_fc2 = torch._grouped_mm(grad.t(), scaled, offs=offs)  # (E, M, F), as fc2
        # the scaled activation's gradient, in the dtype of the product a * p
        product = torch.promote_types(x.dtype, probs.dtype)
        grad_scaled = torch._grouped_mm(grad, fc2, offs=offs).to(product)
        grad_probs = (grad_scaled * a).sum(-1).to(probs.dtype)
        grad_a = (grad_scaled * probs.unsqueeze(-1)).to(a.dtype)
        grad_h = _act_backward(grad_a, h, ctx.glu)
        grad_fc1 = torch._grouped_mm(grad_h.t(), x, offs=offs)  # (E, F1, M), as fc1
        grad_x = torch._grouped_mm(grad_h, fc1, offs=offs)
        return (grad_x, grad_probs, None, None, None,
                *grad_fc1.unbind(0), *grad_fc2.unbind(0))


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """torch's FLOP counter has no formula for _grouped_mm: each row of a meets b's last
    dimension once, whichever dimension the groups split ((T, K) x (E, K, N), the K-grouped
    (M, K) x (K, N), or (E, M, K) x (E, K, N))."""
    count = 1
    for size in a_shape:
        count *= size
    return 2 * count * b_shape[-1]


def register_flop_formula() -> None:
    from torch.utils import flop_counter

    if torch.ops.aten._grouped_mm.default not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


def _pre_hooks(module) -> None:
    """What calling the linear would run before its forward: megatron DDP's forward pre-hooks
    wait there for the parameters' overlapped gather (--overlap-param-gather)."""
    for key, hook in getattr(module, "_forward_pre_hooks", {}).items():
        if key in module._forward_pre_hooks_with_kwargs:
            hook(module, (), {})
        else:
            hook(module, ())


def grouped_experts(experts, x, counts: list, probs):
    """The local experts on rows x (T, M) grouped by expert (counts: rows of each, on the
    host), each row's output scaled by its probability -> (T, M)."""
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    mlps = experts.local_experts
    for mlp in mlps:
        _pre_hooks(mlp.linear_fc1)
        _pre_hooks(mlp.linear_fc2)
    weights = [m.linear_fc1.weight for m in mlps] + [m.linear_fc2.weight for m in mlps]
    return _Grouped.apply(x.contiguous(), probs, offs,
                          experts.config.gated_linear_unit, len(mlps), *weights)


register_flop_formula()  # FlopCounterMode then counts the experts (tests/test_planning.py)
