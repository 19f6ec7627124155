"""Faults survived, from outside (SIGSTOP) or injected with PARM_FAULT (training/faults.py).

A rank stopped from outside ends the whole job within the watchdog's limit, named in one line
(the job's last, no traceback); a save killed
at any phase or failing on a full disk (also written in the background, --async-save) leaves
the previous checkpoint latest and loadable, and the next start names what was left over. (A
rank killed mid-run under MAX_RESTARTS, during a background save: test_checkpoint_resume.py; a
corrupt latest checkpoint and --ckpt-fallback: test_bad_input.py.) And the tests' own: a
launch that hangs fails its test at the timeout with every rank's stack; a launch.sh whose
launcher is killed ends with it.
"""

import contextlib
import os
import random
import re
import subprocess
import time

import pytest

from conftest import (error_lines, free_port, launch, launch_sh, launch_sh_until,
                      tiny_gpt_args, torchrun)

MOE = {"expert-model-parallel-size": 2, "log-interval": 1}


# PARM_STOP_REPEATS=5 repeats each stop from outside at other moments (issue checks)
REPEATS = int(os.environ.get("PARM_STOP_REPEATS", "1"))
STOP_LAYOUT = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
               "expert-tensor-parallel-size": 2, "sequence-parallel": True, "log-interval": 1,
               "train-iters": 60, "save-interval": 4, "distributed-timeout-minutes": 0.5,
               "watchdog-timeout-minutes": 0.25}


def assert_ended_by_the_watchdog(output, seconds, stopped_ranks):
    """Every rank ended within 40 s of the stop, with one `error` line, the output's last,
    naming a stopped rank, and no traceback (neither a rank's nor torchrun's)."""
    assert seconds <= 40, (seconds, output[-3000:])
    errors = error_lines(output)
    assert len(errors) == 1, output[-3000:]
    named = re.search(r"watchdog: rank (\d+)\b.* stopped responding", errors[0])
    assert named and int(named[1]) in stopped_ranks, (errors, stopped_ranks)
    assert "Traceback" not in output, output[-3000:]
    return errors[0]


@pytest.mark.parametrize("repeat", range(REPEATS))
def test_a_rank_stopped_from_outside_ends_the_job_with_one_line(gpt_data, tmp_path, repeat):
    """SIGSTOP from outside to one rank of 4 (TP2 x EP2 + SP, saving every 4 iterations,
    --watchdog-timeout-minutes 0.25: the watchdog fires at 15 s, before gloo's own 30 s of
    --distributed-timeout-minutes 0.5; the default limit: the next test), at
    a random moment after a random iteration (forward, backward, the optimizer or a save):
    scripts/launch.sh ends every rank, the stopped one with SIGKILL, within 40 s."""
    rng = random.Random()
    rank, after, delay = rng.randrange(4), rng.randint(2, 9), rng.uniform(0, 0.3)
    stopped_at = []

    def stop(_, launcher, ranks):
        time.sleep(delay)
        assert len(ranks) == 4, ranks
        ranks[rank].suspend()  # in rank order (one node)
        stopped_at.append(time.monotonic())

    status, output = launch_sh_until(
        4, tiny_gpt_args(gpt_data, **STOP_LAYOUT, save=tmp_path / "ckpt"),
        rf"^ *iteration +{after}/", stop, timeout=90)
    assert stopped_at and status != 0, output[-3000:]
    seconds = time.monotonic() - stopped_at[0]
    line = assert_ended_by_the_watchdog(output, seconds, {rank})
    assert line == output.strip().splitlines()[-1], output[-2000:]
    print(f"\nrank {rank} stopped {delay:.2f} s after iteration {after}, every rank ended "
          f"{seconds:.1f} s later: {line}")


PHASES = ("write", "rename", "renamed", "tracker")


def test_the_watchdog_fires_before_the_collectives_timeout():
    """Without --watchdog-timeout-minutes the watchdog's limit is BEFORE_TIMEOUT (0.8) of
    --distributed-timeout-minutes, so that it names a stopped rank before a collective gives up
    with a bare timeout; a longer watchdog limit is cut to that, a shorter one kept (what the
    stop tests set, to end sooner)."""
    from parm_trainer.arguments import parse_args
    from parm_trainer.training.watchdog import limit_s

    for watchdog, limit in ((None, 24.0), ("1", 24.0), ("0.25", 15.0)):
        flags = ["--distributed-timeout-minutes", "0.5"]
        flags += ["--watchdog-timeout-minutes", watchdog] if watchdog else []
        assert limit_s(parse_args(flags, world_size=1)) == limit, (watchdog, limit)


def test_save_killed_at_any_phase_keeps_the_previous_checkpoint(gpt_data, tmp_path):
    """One run saving every iteration, restarted by torchrun after each fault: attempt k dies
    in the save of iteration k + 2 at the k-th phase (write, before the rename, after it, with
    the tracker half-written). Each restart resumes from iteration k + 1, the latest whole
    checkpoint, names what the interrupted save left, trains the next iterations again with the
    same losses, and the last attempt completes."""
    ckpt = tmp_path / "ckpt"
    args = tiny_gpt_args(gpt_data, **{"train-iters": 6, "save-interval": 1, "save": ckpt,
                                      "load": ckpt, "log-interval": 1})
    faults = ";".join(f"kill-in-save:phase={phase}:iter={k + 2}:attempt={k}"
                      for k, phase in enumerate(PHASES))
    status, output = torchrun(["--nproc-per-node", 1, "--max-restarts", len(PHASES),
                               "--master-port", free_port(), "pretrain_gpt_moe.py", *args],
                              env={"PARM_FAULT": faults})
    assert status == 0, output[-3000:]
    losses = {}
    for it, loss in re.findall(r"iteration +(\d+)/6 \| lm loss ([0-9.]+)", output):
        assert losses.setdefault(int(it), loss) == loss, f"iteration {it} again: {loss}"
    assert sorted(losses) == list(range(1, 7))
    for k, phase in enumerate(PHASES):
        assert f"killed in the save of iteration {k + 2} ({phase})" in output
        assert f"resumed from {ckpt} at iteration {k + 1}" in output
        assert "ignored " + str(ckpt / f"iter_{k + 2:07d}") in output  # what the save left
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        f"iter_{i:07d}" for i in range(1, 7)] + ["latest_checkpointed_iteration.txt"]


def _mount_tmpfs(path, size_bytes) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                           str(path)], capture_output=True).returncode == 0


def test_save_on_a_full_disk_keeps_the_previous_checkpoint(gpt_data, tmp_path):
    """2 ranks save onto a tmpfs with room for one checkpoint and a half: the second save fails
    on every rank with one line, and the first stays latest and loadable. Then the same with
    --async-save: the second save's writers fail in the background, and finalising it at the
    end of training ends every rank with the same one line, the first checkpoint kept."""
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

        subprocess.run(["rm", "-rf", str(ckpt)], check=True)
        background = launch(2, tiny_gpt_args(gpt_data, **flags, save=ckpt, **{"async-save": True}),
                            tmp_path, timeout=120)
        assert background.returncode != 0
        assert f"saving checkpoint {ckpt / 'iter_0000004'} in the background" in background.output
        errors = error_lines(background.output)
        assert len(errors) == 1, background.output[-3000:]
        assert "cannot save" in errors[0] and "MiB free" in errors[0], errors
        assert "]: Traceback" not in background.output
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "iter_0000002", "latest_checkpointed_iteration.txt"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_launch_past_its_timeout_fails_with_where_each_rank_hung(tmp_path):
    """The tests' own launcher (conftest.torchrun): a launch that hangs is stopped at its
    timeout, every rank with it, and the test fails with each process's Python stack, so a
    rare hang in CI says where it hung."""
    script = tmp_path / "hang.py"
    script.write_text("import time\nimport torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "def waits_forever():\n    time.sleep(600)\nwaits_forever()\n")
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        torchrun(["--nproc-per-node", 2, "--master-port", free_port(), script], timeout=10)
    assert time.monotonic() - start < 30
    message = str(failed.value)
    assert "past its 10 s" in message
    assert message.count(f'File "{script}", line 5 in waits_forever') == 2, message[-3000:]


def test_a_launch_whose_rendezvous_hung_runs_once_more(tmp_path):
    """The tests' launcher forks the ranks from torchrun's agent, and a forked rank can hang
    making its store client (tests/torchrun_server.py, watch_rendezvous): such a rank says so
    and exits, and conftest.torchrun runs the launch once more, once. Here every rank reports
    the hang at once (PARM_TEST_RENDEZVOUS_HANG_S=0) while a flag file is absent, in the store
    the project makes under torchrun (parallel._attempt_store); a launch that hangs twice, in
    torch's own env:// store, fails."""
    from conftest import RERUN_NOTE
    from torchrun_server import RENDEZVOUS_HUNG

    flag = tmp_path / "hung_once"
    script = tmp_path / "init.py"  # the store as torch's env:// makes it
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "dist.barrier()\nprint('rank', dist.get_rank(), 'past init')\n")
    project = tmp_path / "init_project.py"  # the store as the project makes it under torchrun
    project.write_text("import datetime\nimport torch.distributed as dist\n"
                       "from parm_trainer import parallel\n"
                       "store = parallel._attempt_store(datetime.timedelta(minutes=1))\n"
                       "assert store, 'not the agent store path'\n"
                       "dist.init_process_group('gloo', **store)\n"
                       "dist.barrier()\nprint('rank', dist.get_rank(), 'past init')\n")
    launcher = tmp_path / "launcher.py"  # the hang on the first launch only
    launcher.write_text(f"import os, runpy\nflag = {str(flag)!r}\n"
                        "if os.environ['RANK'] == '1' and not os.path.exists(flag):\n"
                        "    open(flag, 'w').close()\n"
                        "    os.environ['PARM_TEST_RENDEZVOUS_HANG_S'] = '0'\n"
                        f"runpy.run_path({str(project)!r}, run_name='__main__')\n")
    status, output = torchrun(["--nproc-per-node", 2, "--master-port", free_port(), launcher],
                              timeout=120)
    assert RENDEZVOUS_HUNG in output and RERUN_NOTE in output, output[-3000:]
    assert status == 0, output[-3000:]
    assert output.count("past init") == 2  # the second launch only
    status, output = torchrun(["--nproc-per-node", 2, "--master-port", free_port(), script],
                              env={"PARM_TEST_RENDEZVOUS_HANG_S": "0"}, timeout=120)
    assert status != 0 and output.count(RERUN_NOTE) == 1 and "past init" not in output
    # scripts/launch.sh in the tests forks its ranks from the same server: the same once more
    run = launch_sh(2, [], env={"PARM_TEST_RENDEZVOUS_HANG_S": "0"}, script=str(script))
    assert run.returncode != 0 and run.output.count(RERUN_NOTE) == 1, run.output[-3000:]
    assert run.output.count(RENDEZVOUS_HUNG) >= 2 and "past init" not in run.output


def test_a_rank_ended_by_the_watchdog_takes_its_helpers_with_it(tmp_path):
    """A rank the watchdog ends (os._exit, no teardown) first kills the processes it started:
    megatron's per-file checkpoint writers of a save in progress were left running when a rank
    was stopped during a save, and the orphan held the launcher's output open (the job never
    ended for its reader; seen in this file's first test)."""
    import multiprocessing
    from types import SimpleNamespace

    import psutil

    from parm_trainer.training.watchdog import Watchdog

    pid_file = tmp_path / "helper.pid"

    def rank():
        helper = subprocess.Popen(["sleep", "60"])
        pid_file.write_text(str(helper.pid))
        Watchdog._end(SimpleNamespace(host="here", pid=os.getpid()), {}, 0.0, None)

    process = multiprocessing.get_context("fork").Process(target=rank)
    process.start()
    process.join(30)
    assert process.exitcode == 1
    helper = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(helper) and psutil.Process(helper).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the rank's helper outlived it"
        time.sleep(0.05)


def test_a_served_launch_sh_ends_with_its_launcher(gpt_data):
    """The tests' scripts/launch.sh (tests/launch_client.py as its Python, the wrapper and the
    ranks forked by the server): the ranks write to the launcher's own output, and when the
    launcher is killed outright (SIGKILL, nothing passed on) the server ends the launch: no
    rank trains on unseen."""
    import psutil

    seen = []

    def kill(_, launcher, ranks):
        seen.extend(ranks)
        launcher.kill()

    start = time.monotonic()
    status, output = launch_sh_until(2, tiny_gpt_args(gpt_data, **{**MOE, "train-iters": 500}),
                                     r"^ *iteration +2/", kill, timeout=120)
    assert status == -9 and len(seen) == 2, output[-3000:]
    assert "iteration      2/500" in output  # the ranks' lines, through the launcher's pipe
    for rank in seen:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.wait(timeout=max(1.0, start + 60 - time.monotonic()))
    assert time.monotonic() - start < 60, "the ranks outlived their launcher"
