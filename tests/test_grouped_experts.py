"""parm_trainer/moe/grouped_experts.py against megatron-core's SequentialMLP, the module whose
weights it uses, and the allocator setting that keeps its large tensors in the process.

The same rows (grouped by expert, some experts with none), the same probabilities and the same
output gradient go through megatron's experts and through the two grouped GEMMs: outputs, the
rows' and the probabilities' gradients and every expert's weight gradients agree, for gelu and
SwiGLU, in fp32 and bf16. Where the grouped path would compute another function (biases, the
probabilities on the input), it is not used. And the allocator setting training runs with.
"""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
from parm_trainer.moe.grouped_experts import applies, grouped_experts

HIDDEN, FFN = 32, 48
COUNTS = [5, 0, 17, 3, 0, 11, 1, 9]  # rows per expert, two experts with none


def experts(glu: bool, dtype=torch.float32, **config):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

    settings = dict(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN,
                    moe_ffn_hidden_size=FFN, num_attention_heads=4,
                    num_moe_experts=len(COUNTS), add_bias_linear=False,
                    gated_linear_unit=glu, activation_func=F.silu if glu else F.gelu,
                    bias_activation_fusion=False, params_dtype=dtype,
                    bf16=dtype == torch.bfloat16, use_cpu_initialization=True)
    settings.update(config)
    torch.manual_seed(0)
    module = SequentialMLP(len(COUNTS), TransformerConfig(**settings),
                           MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                         linear_fc2=RowParallelLinear),
                           pg_collection=get_default_pg_collection())
    with torch.no_grad():  # megatron's init leaves the weights small: make every GEMM count
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module


def run(module, grouped: bool, dtype):
    torch.manual_seed(1)
    rows = torch.randn(sum(COUNTS), HIDDEN, dtype=dtype, requires_grad=True)
    probs = torch.rand(sum(COUNTS), requires_grad=True)  # fp32, as the router gives them
    grad = torch.randn(sum(COUNTS), HIDDEN, dtype=dtype)
    for p in module.parameters():
        p.grad = None
    if grouped:
        out = grouped_experts(module, rows, COUNTS, probs)
    else:
        out, _ = module(rows, torch.tensor(COUNTS), probs)
    out.backward(grad)
    return [out, rows.grad, probs.grad, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("glu", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_experts_equal_megatrons_sequential_mlp(one_rank_world, glu, dtype):
    module = experts(glu, dtype)
    x = torch.zeros(1, HIDDEN, dtype=dtype)
    assert applies(module, module.config, x)
    reference, got = run(module, False, dtype), run(module, True, dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    names = ["output", "rows' gradient", "probabilities' gradient",
             *(name for name, _ in module.named_parameters())]
    assert len(got) == len(reference) == 3 + 2 * len(COUNTS)
    for name, a, b in zip(names, got, reference):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        scale = b.abs().max().clamp(min=1e-6)
        assert ((a.float() - b.float()).abs().max() / scale) <= tolerance, name
    # the experts without rows get zero weight gradients, as megatron's empty GEMMs give
    empty = [i for i, c in enumerate(COUNTS) if c == 0]
    fc1s = list(module.parameters())
    assert all(not fc1s[2 * i].grad.any() for i in empty)


@pytest.mark.parametrize("setting", [{"add_bias_linear": True},
                                     {"moe_apply_probs_on_input": True, "moe_router_topk": 1,
                                      "moe_router_pre_softmax": True},
                                     {"activation_func_clamp_value": 7.0}],
                         ids=["biases", "probs_on_input", "clamped"])
def test_another_function_keeps_megatrons_experts(one_rank_world, setting):
    module = experts(True, **setting)
    assert not applies(module, module.config, torch.zeros(1, HIDDEN))


def test_sixteen_bit_rows_need_aligned_widths(one_rank_world):
    """torch._grouped_mm takes 16-bit operands only with strides of whole 16 bytes."""
    module = experts(False, torch.bfloat16)
    assert applies(module, module.config, torch.zeros(1, HIDDEN, dtype=torch.bfloat16))
    assert not applies(module, module.config, torch.zeros(1, HIDDEN + 1, dtype=torch.bfloat16))


def test_tuned_allocator_keeps_large_blocks_in_the_process():
    """glibc hands a block above its mmap threshold (dynamic: at most the largest block freed
    so far) fresh pages from the kernel, faulted in at first touch, and returns them on free;
    after cpu_allocator.tune() a 24 MiB block (the size of a few grouped-expert tensors) comes
    from the heap and stays there once freed, for the next iteration to reuse. In a fresh
    process (tests/worker_allocator.py), read from glibc's own mallinfo2."""
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "worker_allocator.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["before"]["mmapped"] >= 16 << 20, report  # glibc's default, for contrast
    assert report["tuned"], report
    assert report["after"]["mmapped"] == 0 and report["after"]["kept_free"] > 20 << 20, report
