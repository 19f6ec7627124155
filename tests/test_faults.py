"""Faults survived, injected with PARM_FAULT (parm_trainer/training/faults.py).

A rank killed mid-run under MAX_RESTARTS resumes from the last checkpoint with the losses of an
uninterrupted run; a stopped rank ends the whole job within the watchdog's limit, named in one
line; a save killed at any phase or failing on a full disk leaves the previous checkpoint
latest and loadable, and the next start names what was left over.
"""

import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, error_lines, free_port, launch, tiny_gpt_args

MOE = {"expert-model-parallel-size": 2, "log-interval": 1}


def _launch_sh(nproc, args, env, timeout=240):
    """scripts/launch.sh as a user runs it; (return code, output, losses json path)."""
    command = ["bash", "scripts/launch.sh", "pretrain_gpt_moe.py", *args]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "NPROC_PER_NODE": str(nproc),
                              "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
                              "PYTHONWARNINGS": "ignore", **env})
    return run.returncode, run.stdout + run.stderr


def test_killed_rank_restarts_from_the_checkpoint_with_the_same_losses(gpt_data, tmp_path):
    import json

    flags = {**MOE, "train-iters": 20, "save-interval": 5}
    reference = launch(4, tiny_gpt_args(gpt_data, **flags), tmp_path)
    assert reference.returncode == 0, reference.output[-3000:]

    ckpt, losses = tmp_path / "ckpt", tmp_path / "losses.json"
    code, output = _launch_sh(4, tiny_gpt_args(gpt_data, **flags, save=ckpt, load=ckpt,
                                               **{"log-losses-json": losses}),
                              {"MAX_RESTARTS": "2", "PARM_FAULT": "kill:rank=2:iter=7"})
    assert code == 0, output[-4000:]
    assert "PARM_FAULT: rank 2: kill at iteration 7" in output
    assert f"resumed from {ckpt} at iteration 5" in output
    rows = json.loads(losses.read_text())
    assert [row["iteration"] for row in rows] == list(range(1, 21))
    got = [row["lm loss"] for row in rows]
    assert max(abs(a - b) / b for a, b in zip(got, reference.loss())) <= 1e-6


def test_stopped_rank_ends_every_rank_within_the_limit(gpt_data, tmp_path):
    args = tiny_gpt_args(gpt_data, **MOE, **{"train-iters": 50, "watchdog-timeout-minutes": 0.5,
                                            "distributed-timeout-minutes": 1})
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
               "--master-port", str(free_port()), "pretrain_gpt_moe.py", *args]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1",
                                    "PYTHONWARNINGS": "ignore",
                                    "PARM_FAULT": "hang:rank=1:iter=5"})
    lines, stopped_at = [], None
    try:
        for line in process.stdout:
            lines.append(line)
            if "PARM_FAULT: rank 1: hang at iteration 5" in line:
                stopped_at = time.monotonic()
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    ended_at = time.monotonic()
    output = "".join(lines)
    assert stopped_at is not None, output[-3000:]
    assert process.returncode != 0
    assert ended_at - stopped_at <= 40, (ended_at - stopped_at, output[-3000:])
    errors = error_lines(output)
    assert len(errors) == 1, output[-3000:]
    assert "rank 1 stopped responding" in errors[0] and "iteration 5" in errors[0], errors
    print(f"ended {ended_at - stopped_at:.1f} s after the stop: {errors[0]}")


def _ckpt_files(root):
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("phase", ["write", "rename", "renamed", "tracker"])
def test_save_killed_at_any_phase_keeps_the_previous_checkpoint(phase, gpt_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = {"train-iters": 4, "save-interval": 2, "save": ckpt, "log-interval": 1}
    env_fault = {"PARM_FAULT": f"kill-in-save:phase={phase}:iter=4"}
    killed = launch(1, tiny_gpt_args(gpt_data, **flags), tmp_path, env=env_fault)
    assert killed.returncode != 0 and "killed in the save of iteration 4" in killed.output
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    resumed = launch(1, tiny_gpt_args(gpt_data, **flags, load=ckpt), tmp_path)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"resumed from {ckpt} at iteration 2" in resumed.output
    assert "ignored" in resumed.output  # what the interrupted save left is named
    assert [row["iteration"] for row in resumed.losses] == [3, 4]
    assert resumed.loss() == killed.loss()[2:4]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert _ckpt_files(ckpt) == ["iter_0000002", "iter_0000004",
                                 "latest_checkpointed_iteration.txt"]


def _mount_tmpfs(path, size_bytes) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                           str(path)], capture_output=True).returncode == 0


def test_save_on_a_full_disk_keeps_the_previous_checkpoint(gpt_data, tmp_path):
    """2 ranks save onto a tmpfs with room for one checkpoint and a half: the second save fails
    on every rank with one line, and the first stays latest and loadable."""
    flags = {**MOE, "train-iters": 4, "save-interval": 2}
    probe = launch(2, tiny_gpt_args(gpt_data, **{**flags, "train-iters": 2},
                                    save=tmp_path / "probe"), tmp_path)
    assert probe.returncode == 0, probe.output[-3000:]
    size = sum(f.stat().st_size for f in (tmp_path / "probe").rglob("*") if f.is_file())
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, int(size * 1.5)):
        pytest.skip("needs root to mount a tmpfs")
    try:
        ckpt = disk / "ckpt"
        run = launch(2, tiny_gpt_args(gpt_data, **flags, save=ckpt), tmp_path, timeout=120)
        assert run.returncode != 0
        errors = error_lines(run.output)
        assert len(errors) == 1, run.output[-3000:]
        assert "cannot save" in errors[0] and "MiB free" in errors[0], errors
        assert "]: Traceback" not in run.output  # torchrun prints its own summary
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "iter_0000002", "latest_checkpointed_iteration.txt"]
        resumed = launch(2, tiny_gpt_args(gpt_data, **{**flags, "train-iters": 3}, load=ckpt),
                         tmp_path)
        assert resumed.returncode == 0, resumed.output[-3000:]
        assert f"resumed from {ckpt} at iteration 2" in resumed.output
        assert resumed.loss() == run.loss()[2:3]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_corrupt_latest_checkpoint_is_refused_or_skipped_with_ckpt_fallback(gpt_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = {"train-iters": 4, "save-interval": 2, "log-interval": 1}
    first = launch(1, tiny_gpt_args(gpt_data, **flags, save=ckpt), tmp_path)
    assert first.returncode == 0, first.output[-3000:]
    shard = sorted((ckpt / "iter_0000004").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    flags["train-iters"] = 6
    refused = launch(1, tiny_gpt_args(gpt_data, **flags, load=ckpt), tmp_path, timeout=120)
    assert refused.returncode != 0
    errors = error_lines(refused.output)
    assert len(errors) == 1 and "iter_0000004" in errors[0], refused.output[-3000:]
    fallback = launch(1, tiny_gpt_args(gpt_data, **flags, load=ckpt, **{"ckpt-fallback": True}),
                      tmp_path)
    assert fallback.returncode == 0, fallback.output[-3000:]
    assert "resumed from the newest readable checkpoint, iteration 2" in fallback.output
    assert [row["iteration"] for row in fallback.losses] == [3, 4, 5, 6]
    assert fallback.loss()[:2] == first.loss()[2:4]
