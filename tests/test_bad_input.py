"""Bad input ends every rank fast, with one line naming the cause and a non-zero exit.

Each case is a real torchrun launch: on 4 ranks where the layout itself is the bad input, on 2
where the check is the same whatever the layout (data, profile: 2 ranks show every rank ending
as well as 4, at half the start-up), on 1 where the case needs no parallelism."""

import re
import shutil
import socket

import pytest

from conftest import (assert_clean_failure, error_lines, last_line, launch, launch_sh,
                      tiny_gpt_args)


@pytest.mark.parametrize("case,world,flags,needles", [
    ("tp3_on_4", 4, {"tensor-model-parallel-size": 3, "num-attention-heads": 6,
                     "hidden-size": 96}, ["--tensor-model-parallel-size 3", "world size 4"]),
    ("5_experts_ep2", 2, {"num-experts": 5, "expert-model-parallel-size": 2},
     ["--num-experts 5", "--expert-model-parallel-size 2"]),
])
def test_impossible_layout(case, world, flags, needles, gpt_data):
    """Through scripts/launch.sh, as a user runs a job: the error line is the output's last."""
    run = launch_sh(world, tiny_gpt_args(gpt_data, **flags))
    assert_clean_failure(run, *needles)
    assert last_line(run.output) == error_lines(run.output)[0], run.output[-3000:]
    assert "Traceback" not in run.output, run.output[-3000:]  # torchrun's report in its log


def test_malformed_cost_profile(gpt_data, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text('{"gpus_per_node": 4, "collectives": {}, "compute": {}}')
    run = launch(2, tiny_gpt_args(gpt_data, **{"moe-parm-schedule": "auto",
                                               "moe-parm-cost-profile": profile}),
                 tmp_path, timeout=120)
    assert_clean_failure(run, str(profile), "collectives must have exactly the kinds")


def test_missing_data_path(gpt_data, tmp_path):
    run = launch_sh(2, tiny_gpt_args(gpt_data, **{"data-path": tmp_path / "nowhere"}))
    assert_clean_failure(run, "--data-path", "nowhere")
    assert last_line(run.output) == error_lines(run.output)[0], run.output[-3000:]


def test_launch_sh_ends_with_the_error_line(gpt_data):
    """argparse's line (after its usage) and a busy MASTER_PORT, through scripts/launch.sh:
    the job's last line names the cause; torchrun's report only in its log file (the real
    launch: a served one's ranks are functions torchrun's report names otherwise)."""
    run = launch_sh(1, tiny_gpt_args(gpt_data, **{"num-experts": "four"}), real=True)
    assert run.returncode != 0
    assert last_line(run.output) == ("pretrain_gpt_moe.py: error: argument --num-experts: "
                                     "invalid int value: 'four'"), run.output[-3000:]
    report = re.search(r"^\(torchrun's report: (\S+)\)$", run.output, re.M)
    assert report and "pretrain_gpt_moe.py FAILED" in open(report.group(1)).read(), run.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = launch_sh(1, tiny_gpt_args(gpt_data), env={"MASTER_PORT": str(port)})
    assert run.returncode != 0 and "Traceback" not in run.output, run.output[-3000:]
    assert last_line(run.output).startswith(f"error: MASTER_PORT {port} is in use"), run.output


def test_no_data_path_flag(gpt_data, tmp_path):
    args = tiny_gpt_args(gpt_data)
    at = args.index("--data-path")
    del args[at:at + 2]
    run = launch(2, args, tmp_path, timeout=120)
    assert_clean_failure(run, "--data-path is required")


def test_corrupt_idx(gpt_data, tmp_path):
    prefix = tmp_path / "corrupt_text_document"
    shutil.copy(gpt_data["prefix"] + ".bin", str(prefix) + ".bin")
    idx = open(gpt_data["prefix"] + ".idx", "rb").read()
    open(str(prefix) + ".idx", "wb").write(idx[: len(idx) // 2])  # truncated
    run = launch(2, tiny_gpt_args(gpt_data, **{"data-path": prefix}), tmp_path, timeout=120)
    assert_clean_failure(run, "corrupt_text_document.idx")


def test_nan_loss_stops_before_the_update(gpt_data, tmp_path):
    """SGD with an absurd learning rate overflows the weights; the next loss is not finite."""
    ckpt = tmp_path / "ckpt"
    flags = {"optimizer": "sgd", "lr": 1e30, "clip-grad": 0, "train-iters": 6, "save": ckpt,
             "save-interval": 1}
    run = launch(1, tiny_gpt_args(gpt_data, **flags), tmp_path, timeout=120)
    assert run.returncode != 0
    line = error_lines(run.output)[0]
    assert "loss is" in line and "no update was applied" in line, line
    # every checkpoint written before the failure is whole, and the tracker names one of them
    latest = (ckpt / "latest_checkpointed_iteration.txt").read_text()
    assert (ckpt / f"iter_{int(latest):07d}" / "metadata.json").exists()
    # the same stop on 2 ranks from an injected NaN (PARM_FAULT), and a malformed PARM_FAULT
    injected = launch(2, tiny_gpt_args(gpt_data, **{"train-iters": 4}), tmp_path, timeout=120,
                      env={"PARM_FAULT": "nan:iter=3"})
    assert_clean_failure(injected, "loss is nan at iteration 3", "no update was applied")
    malformed = launch(2, tiny_gpt_args(gpt_data), tmp_path, timeout=120,
                       env={"PARM_FAULT": "kill:rank=1"})
    assert_clean_failure(malformed, "PARM_FAULT 'kill:rank=1': give iter=N")


def test_corrupt_checkpoint(gpt_data, tmp_path):
    """A truncated shard in the latest checkpoint is refused naming it; --ckpt-fallback resumes
    from the one before with the losses the first run had there. The first (good) run also
    checks the tensorboard and offline wandb logs get written."""
    ckpt, board, wandb_dir = tmp_path / "ckpt", tmp_path / "tb", tmp_path / "wandb"
    first = launch(1, tiny_gpt_args(gpt_data, **{
        "train-iters": 4, "save-interval": 2, "save": ckpt, "tensorboard-dir": board,
        "wandb-project": "parm-test", "wandb-save-dir": wandb_dir}), tmp_path)
    assert first.returncode == 0, first.output[-3000:]
    assert list(board.glob("events.out.tfevents.*")), "no tensorboard events"
    assert list(wandb_dir.glob("offline-run-*/*.wandb")), sorted(wandb_dir.rglob("*"))[:5]
    shard = sorted((ckpt / "iter_0000004").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    flags = {"train-iters": 6, "load": ckpt}
    run = launch(1, tiny_gpt_args(gpt_data, **flags), tmp_path, timeout=120)
    assert_clean_failure(run, "--load", "iter_0000004", "cannot read checkpoint")
    fallback = launch(1, tiny_gpt_args(gpt_data, **flags, **{"ckpt-fallback": True}), tmp_path)
    assert fallback.returncode == 0, fallback.output[-3000:]
    assert "resumed from the newest readable checkpoint, iteration 2" in fallback.output
    assert [row["iteration"] for row in fallback.losses] == [3, 4, 5, 6]
    assert fallback.loss()[:2] == first.loss()[2:4]
