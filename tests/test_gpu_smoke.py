"""scripts/gpu_smoke.sh --dry-run: every stage of the GPU check runs on CPU and passes, so the
script is known to work before a GPU machine is spent on it; without --dry-run and without
CUDA it refuses in one line."""

import json
import os
import re
import subprocess
from types import SimpleNamespace

from conftest import ROOT, served_env


def test_dry_run_every_stage_passes(gpt_data, tmp_path):
    result = subprocess.run(
        ["bash", "scripts/gpu_smoke.sh", "--dry-run", "--data-path", gpt_data["prefix"],
         "--tokenizer-model", gpt_data["tokenizer"], "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, **served_env(python=False)})  # its torchruns' ranks forked
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    rows = re.findall(r"^\| (.+?) +\| (\w+) \| [\d.]+ \| (.*) \|$", result.stdout, re.M)
    names = [name for name, _, _ in rows]
    assert names == ["environment", "collectives", "MoE layer fp32", "MoE layer bf16",
                     "MoE layer, grouped experts", "timed layer table", "short pretrain"], \
        result.stdout[-4000:]
    assert all(verdict == "ok" for _, verdict, _ in rows), rows
    detail = {name: text for name, _, text in rows}
    assert detail["collectives"] == "18/18 ops agree"
    assert detail["MoE layer fp32"].startswith("4 schedules")
    assert detail["MoE layer bf16"].startswith("4 schedules; worst rel L2")
    # megatron's GroupedMLP (--moe-grouped-gemm) on CPU; the environment says so
    assert detail["MoE layer, grouped experts"].startswith("4 schedules (GroupedMLP); worst")
    assert "stage 5: --moe-grouped-gemm (GroupedMLP)" in detail["environment"]
    for schedule in ("s1", "s2", "auto", "megatron-alltoall", "megatron-allgather"):
        assert f"{schedule} " in detail["timed layer table"]
    assert detail["short pretrain"].endswith(
        "; qkv ColumnParallelLinear, norm WrappedTorchNorm, experts SequentialMLP")
    losses = re.search(r"lm loss ([\d.]+) -> ([\d.]+)", detail["short pretrain"])
    assert float(losses.group(2)) < float(losses.group(1))
    assert "schedule" in result.stdout and "fwd+bwd ms" in result.stdout  # the timed table


def test_refuses_without_cuda_unless_dry_run():
    result = subprocess.run(["bash", "scripts/gpu_smoke.sh"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: no CUDA device here; run with --dry-run to check the script on CPU"]


def test_layer_stages_share_one_launch_and_fall_back_to_one_each(tmp_path, monkeypatch):
    """Stages 3-6 ask bench_moe_layer for their layers in one launch (--configs); where that
    launch fails, each stage runs its own launch, so the failure is pinned to a stage."""
    from parm_trainer.bench import smoke

    launches = []

    def bench(args, extra, json_path, timeout):
        launches.append(extra)
        if "--configs" in extra:
            with open(extra[extra.index("--configs") + 1]) as f:
                names = [entry["name"] for entry in json.load(f)]
            if fail_together:
                return None, "boom"
            return {"runs": [{"name": name} for name in names]}, "together"
        return {"name": "alone", "argv": extra}, "alone"

    monkeypatch.setattr(smoke, "_bench", bench)
    args = SimpleNamespace(dry_run=True, nproc=2, out_dir=str(tmp_path), layer_runs=None,
                           layer_stages=["MoE layer fp32", "MoE layer bf16", "timed layer table"])
    fail_together = False
    assert smoke._layer_runs(args, "MoE layer fp32") == ({"name": "MoE layer fp32"}, "together")
    assert smoke._layer_runs(args, "timed layer table")[0] == {"name": "timed layer table"}
    assert len(launches) == 1 and "--bf16" not in launches[0]  # stage 5 not asked: not run
    args.layer_runs, launches[:] = None, []
    fail_together = True
    run, output = smoke._layer_runs(args, "MoE layer bf16")
    assert output == "alone" and "--bf16" in run["argv"] and "--configs" not in run["argv"]
    assert smoke._layer_runs(args, "MoE layer fp32")[0]["argv"] == smoke._check_argv(False)
    assert len(launches) == 3  # the failed one, then one for each stage asked of it
