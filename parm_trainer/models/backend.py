"""Which optional GPU libraries a machine has, and the flags that use them.

Transformer Engine (--transformer-impl transformer_engine), apex (megatron's local spec takes
its fused LayerNorm by itself) and grouped_gemm (megatron's GroupedMLP on GPUs) are optional;
nothing here imports them, so asking costs nothing where they are missing.
"""

from __future__ import annotations

import importlib.util

LIBRARIES = (("transformer_engine", "Transformer Engine"), ("apex", "apex"),
             ("grouped_gemm", "grouped_gemm"))


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def library_report(names=("transformer_engine", "apex")) -> str:
    """'Transformer Engine installed, apex not installed', for the modules named."""
    return ", ".join(f"{label} {'installed' if installed(name) else 'not installed'}"
                     for name, label in LIBRARIES if name in names)


def grouped_experts(cuda: bool) -> tuple:
    """(flags, the experts module they build) that put each rank's experts in grouped GEMMs
    here: Transformer Engine's TEGroupedMLP on a GPU with it, else megatron's GroupedMLP where
    grouped_gemm is installed or on CPU (one matmul per expert); ([], None) where neither."""
    if cuda and installed("transformer_engine"):
        return ["--transformer-impl", "transformer_engine", "--moe-grouped-gemm"], "TEGroupedMLP"
    if not cuda or installed("grouped_gemm"):
        return ["--moe-grouped-gemm"], "GroupedMLP"
    return [], None
