"""The slurm batch scripts under a real slurm (Debian's 22.05) on 2 emulated nodes x 2 ranks.

parm_trainer/cluster/slurm.py starts slurmctld here and a slurmd in each emulated node; the
jobs are submitted with sbatch as a user submits them, with the layout and model set in the
environment as the scripts' comments describe. One cluster serves every job: GPT with a node's
ranks killed after its first checkpoint (requeued, resumed), BERT straight through, two bad
submissions at once (a layout that does not fit, a missing data path), and a refused one.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, max_relative, torchrun

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode,
    reason="needs root and iproute2 network namespaces")

ITERS = 10
MODEL = {"TP": "2", "EP": "2", "NUM_EXPERTS": "4", "TOPK": "2", "NUM_LAYERS": "2",
         "HIDDEN": "64", "HEADS": "4", "SEQ": "64", "MOE_FFN": "128", "MBS": "2", "GBS": "8",
         "TRAIN_ITERS": str(ITERS), "WARMUP": "2", "SAVE_INTERVAL": "4", "LOG_INTERVAL": "1",
         "EVAL_INTERVAL": "1000", "EVAL_ITERS": "1", "SPLIT": "90,5,5", "PYTHONWARNINGS": "ignore"}


def _settings(data, run_dir):
    return {**MODEL, "DATA_PATH": data["prefix"], "TOKENIZER_MODEL": data["tokenizer"],
            "RUN_DIR": str(run_dir)}


def _reference(script, settings, losses, tmp_path):
    """The same job on this machine, 1 node x 4 ranks: the arguments scripts/SCRIPT gives
    pretrain (read by running it with PYTHON set to a script that prints them), launched
    through conftest.torchrun."""
    printer = tmp_path / "print_argv.sh"
    printer.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    printer.chmod(0o755)
    env = {**os.environ, **settings, "NPROC_PER_NODE": "4", "PYTHON": str(printer)}
    shown = subprocess.run(["bash", f"scripts/{script}", "--log-losses-json", str(losses)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr[-3000:]
    argv = shown.stdout.splitlines()
    entry = next(i for i, item in enumerate(argv) if item.startswith("pretrain_"))
    status, output = torchrun(["--nproc-per-node", 4, "--master-port", free_port(),
                               *argv[entry:]], {**settings, "OMP_NUM_THREADS": "1"})
    assert status == 0, output[-3000:]
    return [row["lm loss"] for row in json.loads(losses.read_text())]


def _submit(slurm, script, settings, out, *sbatch_flags, extra=()):
    run = slurm.run("sbatch", "--parsable", "--output", str(out), *sbatch_flags,
                    f"scripts/{script}", *extra, cwd=ROOT, **settings)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().split(";")[0]


def _wait_for_text(path, text, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s: "
                         + (path.read_text()[-3000:] if path.exists() else "(no file)"))


def _ours():
    """slurm and munge daemons still running (zombies excluded), and our state dirs."""
    ps = subprocess.run(["ps", "-eo", "stat=,comm="], capture_output=True, text=True).stdout
    daemons = [line for line in ps.splitlines()
               if line.split()[1] in ("slurmctld", "slurmd", "slurmstepd", "munged")
               and not line.startswith("Z")]
    return daemons + [d for d in os.listdir("/tmp") if d.startswith("parm_slurm_")]


def test_batch_scripts_train_requeue_and_refuse(gpt_data, bert_data, tmp_path):
    from parm_trainer.cluster.netns import Cluster
    from parm_trainer.cluster.slurm import Slurm

    before = _ours()
    gpt, bert = _settings(gpt_data, tmp_path / "gpt"), _settings(bert_data, tmp_path / "bert")
    nodes = ("--nodes", "2", "--gpus-per-node", "2")
    tag = f"ps{os.getpid() % 10000}"
    with Cluster(2, "1gbit", tag=tag) as cluster, \
            Slurm(cluster, gpus_per_node=2) as slurm:
        # GPT: node 1's ranks die at iteration 6 (checkpoint at 4); the job requeues itself
        out, losses = tmp_path / "gpt.out", tmp_path / "gpt_losses.json"
        job = _submit(slurm, "slurm_gpt_moe.sbatch", gpt, out, *nodes,
                      extra=("--log-losses-json", str(losses)))
        _wait_for_text(out, "iteration      6/", timeout=120)
        assert slurm.kill_ranks(1, "pretrain_gpt_moe.py"), "no rank of node 1 found"
        # the references, on this machine, while slurm requeues the job (a wait of seconds)
        expected_gpt = _reference("train_gpt_moe.sh", {**gpt, "RUN_DIR": str(tmp_path / "rg")},
                                  tmp_path / "ref_gpt.json", tmp_path)
        expected_bert = _reference("train_bert_moe.sh", {**bert, "RUN_DIR": str(tmp_path / "rb")},
                                   tmp_path / "ref_bert.json", tmp_path)
        record = slurm.wait_job(job, timeout=180)
        log = out.read_text()
        assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record, log[-3000:])
        assert "after saving iteration 4; requeued" in log, log[-3000:]
        assert re.search(r"job \d+ \(attempt 2\).*latest checkpoint: 4", log), log[-3000:]
        assert "at iteration 4" in log.split("(attempt 2)")[1], log[-3000:]
        got = [row["lm loss"] for row in json.loads(losses.read_text())]
        assert len(got) == ITERS and max_relative(got, expected_gpt) <= 1e-5, (got, expected_gpt)

        # BERT: straight through, the losses of launch.sh's run
        out, losses = tmp_path / "bert.out", tmp_path / "bert_losses.json"
        job = _submit(slurm, "slurm_bert_moe.sbatch", bert, out, *nodes,
                      extra=("--log-losses-json", str(losses)))
        record = slurm.wait_job(job, timeout=180)
        assert record["JobState"] == "COMPLETED", (record, out.read_text()[-3000:])
        got = [row["lm loss"] for row in json.loads(losses.read_text())]
        assert len(got) == ITERS and max_relative(got, expected_bert) <= 1e-5, (got, expected_bert)

        # bad submissions, one node each, side by side: each ends FAILED with one error line
        bad = {"layout": ({**gpt, "TP": "4", "RUN_DIR": str(tmp_path / "bad1")},
                          "--tensor-model-parallel-size 4"),
               "data": ({**gpt, "TP": "1", "DATA_PATH": str(tmp_path / "nowhere"),
                         "RUN_DIR": str(tmp_path / "bad2")}, "nowhere")}
        jobs = {name: _submit(slurm, "slurm_gpt_moe.sbatch", settings, tmp_path / f"{name}.out",
                              "--nodes", "1", "--gpus-per-node", "2")
                for name, (settings, _) in bad.items()}
        for name, (_, needle) in bad.items():
            record = slurm.wait_job(jobs[name], timeout=120)
            log = (tmp_path / f"{name}.out").read_text()
            errors = [line for line in log.splitlines() if line.startswith("error")]
            assert record["JobState"] == "FAILED" and record["Restarts"] == "0", (record, log)
            assert errors and needle in errors[0], log[-3000:]
        # more nodes than the cluster has: sbatch refuses at once
        refused = slurm.run("sbatch", "--nodes", "3", "scripts/slurm_gpt_moe.sbatch", cwd=ROOT)
        assert refused.returncode != 0 and "Node count specification invalid" in refused.stderr
        state = slurm.state
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not os.path.exists(state) and _ours() == before and tag not in namespaces, _ours()


def test_tool_runs_a_command_against_its_slurm_and_removes_it():
    """tools/slurm_cluster.py as README gives it: the command sees the nodes (sinfo), its exit
    status is the tool's, and nothing is left afterwards."""
    before = _ours()
    run = subprocess.run([sys.executable, "tools/slurm_cluster.py", "--nodes", "2",
                          "--gpus-per-node", "2", "--", "bash", "-c",
                          "sinfo -h -N -o '%N %t %G'; sbatch --nodes 3 scripts/slurm_gpt_moe.sbatch"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    nodes = re.findall(r"^(\S+n[01]) idle gpu:2$", run.stdout, re.M)
    assert len(nodes) == 2 and run.stdout.startswith("slurm_cluster: nodes "), run.stdout
    assert "Node count specification invalid" in run.stderr, run.stderr
    assert _ours() == before, _ours()
