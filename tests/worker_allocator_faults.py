"""Page faults per iteration of 64 grouped experts after cpu_allocator.tune(), in a process of
its own (tests/test_grouped_experts.py): prints [tuned, [faults per iteration]] as JSON."""

import json
import resource

import torch

from parm_trainer.compat import cpu_allocator
from parm_trainer.moe.grouped_experts import grouped_experts

COUNT, WIDTH, ROWS, FFN = 64, 128, 128, 256


class _Linear:
    def __init__(self, *shape):
        self.weight = torch.randn(*shape, requires_grad=True)


class _Mlp:
    def __init__(self):
        self.linear_fc1, self.linear_fc2 = _Linear(FFN, WIDTH), _Linear(WIDTH, FFN)


class _Experts:  # what grouped_experts reads of megatron's SequentialMLP
    local_experts = [_Mlp() for _ in range(COUNT)]
    config = type("Config", (), {"gated_linear_unit": False})


tuned = cpu_allocator.tune() and cpu_allocator.tune()  # a second call changes nothing
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rows = torch.randn(COUNT * ROWS, WIDTH, requires_grad=True)
    out = grouped_experts(_Experts, rows, [ROWS] * COUNT, torch.rand(COUNT * ROWS))
    out.sum().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([tuned, faults]))
