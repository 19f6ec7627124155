"""Readers of bench_moe_layer's JSON (a run: {"name", "config", "schedules": {row: result}}),
for the report and for the tools that read it back (bench_sweep, validate_cost_model).
Imports nothing heavy."""

from __future__ import annotations

KINDS = ("alltoall", "allgather", "reducescatter", "allreduce")
DIFF_KEYS = ("output", "input_grad", "gate_grad", "expert_grad", "aux_loss")


def total_ms(result):
    """A row's time: forward + backward of one iteration, max over ranks of the median (ms);
    None for a row that did not run."""
    if not result or result.get("status") != "ok" or not result.get("total_ms"):
        return None
    return result["total_ms"]["max"]


def fmt(value, spec):
    return "-" if value is None else format(value, spec)
