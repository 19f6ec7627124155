"""tools/gpu_smoke.py's commands: how it runs the project's tools (run, torchrun, the layout
for the ranks there are) and its MoE layer stages (3-6), which ask bench_moe_layer for every
layer they need in one launch (--configs) and check each run against the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from parm_trainer.launch import torchrun_command
from parm_trainer.models.backend import grouped_experts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP32_TOL = 1e-5
BF16_TOL = {"output": 2e-2, "input_grad": 2e-2, "gate_grad": 5e-2, "expert_grad": 5e-2}
DIFF_KEYS = ("output", "input_grad", "gate_grad", "expert_grad")
NO_GROUPED = "skipped: neither Transformer Engine nor grouped_gemm is installed"
LAYER_STAGES = ("MoE layer fp32", "MoE layer bf16", "MoE layer, grouped experts",
                "timed layer table")


def run(command: list, timeout: float) -> tuple:
    """(exit status, output) of a command run in the repository root."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONWARNINGS": "ignore"}
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired as error:
        return 124, f"timed out after {timeout:.0f} s\n{error.stdout or ''}"
    return done.returncode, done.stdout + done.stderr


def torchrun(nproc: int) -> list:
    return [*torchrun_command(), "--nproc-per-node", str(nproc),
            "--master-port", str(29600 + os.getpid() % 300)]


def layout_flags(nproc: int) -> list:
    """["--nproc", N, layout flags...] for the ranks there are: MP2 x EP2 x ESP2 with SP on 4
    or more (the demo's), EP2 on 2, one rank otherwise."""
    if nproc >= 4:
        return ["--nproc", "4", "--tensor-model-parallel-size", "2",
                "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2",
                "--sequence-parallel"]
    if nproc >= 2:
        return ["--nproc", "2", "--expert-model-parallel-size", "2"]
    return ["--nproc", "1"]


def _bench(args, extra: list, json_path: str, timeout: float) -> tuple:
    command = [sys.executable, "tools/bench_moe_layer.py", *layout_flags(args.nproc),
               "--json", json_path, *extra]
    status, output = run(command, timeout)
    if status != 0 or not os.path.exists(json_path):
        return None, output
    with open(json_path) as f:
        return json.load(f), output


def _check_argv(bf16: bool, extra=()) -> list:
    """Stages 3-5: a small layer, every schedule against the reference."""
    return [*extra, "--num-experts", "4", "--moe-router-topk", "2", "--hidden-size", "64",
            "--moe-ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "2",
            "--moe-aux-loss-coeff", "0.01", "--iters", "0", "--warmup", "0",
            "--schedules", "baseline,s1,s2,megatron", "--moe-parm-chunks", "2",
            *(["--bf16"] if bf16 else [])]


def _timed_argv(args) -> list:
    """Stage 6: a larger layer (on a GPU), Parm's schedules and megatron's, timed."""
    big = not args.dry_run
    return ["--num-experts", "8" if big else "4", "--moe-router-topk", "2",
            "--hidden-size", "1024" if big else "64",
            "--moe-ffn-hidden-size", "4096" if big else "128",
            "--seq-length", "2048" if big else "32", "--micro-batch-size", "4" if big else "2",
            "--iters", "20" if big else "2", "--warmup", "5" if big else "1",
            "--schedules", "s1,s2,auto,megatron-alltoall,megatron-allgather",
            "--moe-parm-chunks", "0", "--ratio-to", "megatron-alltoall"]


def _layer_argv(args, name: str) -> list | None:
    """The bench_moe_layer flags of layer stage `name` (None: the stage has nothing to run)."""
    if name == "timed layer table":
        return _timed_argv(args)
    if name == "MoE layer, grouped experts":
        flags, _ = grouped_experts(not args.dry_run)
        return _check_argv(True, flags) if flags else None
    return _check_argv(name == "MoE layer bf16")


def _layer_runs(args, name: str) -> tuple:
    """(run of layer stage `name` or None, the output that made it). Every layer stage asked
    (3-6) runs in one launch of bench_moe_layer (--configs: one rendezvous and one start-up,
    not four); where that launch fails, each stage runs in a launch of its own, so the table
    says which failed."""
    if args.layer_runs is None:
        names = [n for n in args.layer_stages if _layer_argv(args, n) is not None]
        layout = layout_flags(args.nproc)[2:]
        configs = os.path.join(args.out_dir, "layer_configs.json")
        with open(configs, "w") as f:
            json.dump([{"name": n, "argv": [*layout, *_layer_argv(args, n)]} for n in names], f)
        payload, output = _bench(args, ["--configs", configs],
                                 os.path.join(args.out_dir, "layers.json"), 300 + 300 * len(names))
        runs = {r["name"]: r for r in payload["runs"]} if payload else None
        args.layer_runs = (runs, output)
    runs, output = args.layer_runs
    if runs is not None:
        return runs.get(name), output
    return _bench(args, _layer_argv(args, name), os.path.join(
        args.out_dir, f"layer {name}.json".replace(" ", "_").replace(",", "")), 600)


def _layer_check(args, name: str, bf16: bool, experts=None) -> tuple:
    run, output = _layer_runs(args, name)
    if run is None:
        return False, "bench_moe_layer failed", output
    problems, worst, rows = [], {}, 0
    for schedule, result in run["schedules"].items():
        if result["status"] != "ok":
            continue  # a schedule the layout cannot run (the table says why)
        rows += 1
        if experts and result.get("experts") != experts:
            problems.append(f"{schedule} built {result.get('experts')}, not {experts}")
        for key in DIFF_KEYS:
            if bf16:
                value, bound = result["rel_l2_diff"][key], BF16_TOL[key]
            else:
                value = result["max_abs_diff"][key]
                bound = FP32_TOL * max(1.0, result["reference_max_abs"][key])
            worst[key] = max(worst.get(key, 0.0), value)
            if not value <= bound:
                problems.append(f"{schedule} {key} {value:.1e} > {bound:.1e}")
    measure = "rel L2" if bf16 else "max abs"
    built = f" ({experts})" if experts else ""
    detail = f"{rows} schedules{built}; worst {measure}: " + ", ".join(
        f"{k} {v:.1e}" for k, v in worst.items())
    if problems:
        detail += "; " + "; ".join(problems)
    return rows > 0 and not problems, detail, output


def stage_layer_fp32(args) -> tuple:
    return _layer_check(args, "MoE layer fp32", bf16=False)


def stage_layer_bf16(args) -> tuple:
    return _layer_check(args, "MoE layer bf16", bf16=True)


def stage_layer_grouped(args) -> tuple:
    flags, experts = grouped_experts(not args.dry_run)
    if not flags:
        return None, NO_GROUPED, ""
    return _layer_check(args, "MoE layer, grouped experts", bf16=True, experts=experts)


def stage_timed(args) -> tuple:
    from parm_trainer.bench.report import format_table

    run, output = _layer_runs(args, "timed layer table")
    if run is None:
        return False, "bench_moe_layer failed", output
    times = {name: r["total_ms"]["max"] for name, r in run["schedules"].items()
             if r["status"] == "ok"}
    detail = ", ".join(f"{name} {ms:.2f} ms" for name, ms in times.items())
    return bool(times), f"fwd+bwd: {detail}", format_table(run)
