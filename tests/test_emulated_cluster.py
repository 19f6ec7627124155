"""tools/emulated_cluster.py: a real multi-node launch (scripts/launch.sh in two network
namespaces over a shaped bridge) trains the same model as one node, and nothing the tool
creates outlives it, also when the command fails. Needs root and `ip netns`; skipped elsewhere.
The nodes' ranks are forked by the tests' torchrun server inside each node's namespaces
(conftest.served_env), but where the tool stops a node's ranks by their environment.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, launch, once_more_if_hung, served_env, tiny_gpt_args
from parm_trainer.cluster.netns import default_tag

TOOL = ROOT / "tools/emulated_cluster.py"


def _netns_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _netns_works(),
                                reason="needs root and iproute2 network namespaces")


def _leftovers(tag):
    """Namespaces, links and /etc/netns entries of the tool's run that named them with `tag`
    (netns.Cluster's names: the tag, then br, nN, vN or hN), not another run's beside it (a
    tag is pt and a process id)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    ours = list(names)
    ours += [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
    if os.path.isdir("/etc/netns"):
        ours += os.listdir("/etc/netns")
    return [name for name in ours if re.fullmatch(rf"{tag}(\D.*)?", name)]


def emulated(command, tmp_path, *flags, timeout=300, served=True):
    """The tool's run (as subprocess.run gives it) and what is left of its cluster. Unless not
    `served`, each node's launch.sh runs its wrapper through launch_client.py
    (conftest.served_env: the ranks forked by the tests' torchrun server, in the node's
    namespaces), once more where a forked rank's rendezvous hung (conftest.once_more_if_hung)."""
    argv = [sys.executable, str(TOOL), "--nodes", "2", "--procs-per-node", "2", "--log-dir",
            str(tmp_path / "logs"), "--master-port", str(free_port()), "--grace", "10", *flags,
            "--", *command]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(served_env() if served else {})}
    runs, left = [], []

    def once() -> tuple:
        with subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) as tool:
            try:
                out, err = tool.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                tool.kill()
                raise
        runs.append(subprocess.CompletedProcess(argv, tool.returncode, out, err))
        left.extend(_leftovers(default_tag(tool.pid)))
        return tool.returncode, "".join(path.read_text()
                                        for path in (tmp_path / "logs").glob("node*.log"))

    once_more_if_hung(once)
    return runs[-1], left


def test_two_nodes_train_like_one_and_survive_a_failed_link(gpt_data, tmp_path):
    """TP2 x EP2 x ESP2 + SP: MP and ESP inside a node, EP across the shaped link. Node 1's link
    goes down as iteration 4 is logged: both nodes end within the watchdog's limit plus 10 s.
    Launched again with the link back, the run resumes from its checkpoint at 3, and iterations
    1-8 (3 before the failure, 5 after) equal those of the same 4 ranks on one node."""
    flags = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
             "expert-tensor-parallel-size": 2, "sequence-parallel": True, "train-iters": 8}
    single = launch(4, tiny_gpt_args(gpt_data, **flags), tmp_path)
    assert single.returncode == 0, single.output[-3000:]

    losses_json, ckpt, limit_s = tmp_path / "emulated_losses.json", tmp_path / "ckpt", 15
    command = ["pretrain_gpt_moe.py", *tiny_gpt_args(gpt_data, **flags, save=ckpt, load=ckpt),
               "--save-interval", "3", "--watchdog-timeout-minutes", str(limit_s / 60),
               "--log-losses-json", str(losses_json)]
    start = time.monotonic()
    failed, left = emulated(command, tmp_path, "--inter-node-bandwidth", "200mbit",
                            "--fail-link-at", "iteration      4/")
    took = time.monotonic() - start
    assert failed.returncode != 0 and left == [], failed.stdout[-3000:] + failed.stderr[-3000:]
    cut = re.search(r"took node 1's link down ([0-9.]+) s after the launch", failed.stdout)
    assert cut, failed.stdout[-3000:]
    assert took - float(cut.group(1)) <= limit_s + 10, (took, cut.group(1))
    node0, node1 = ((tmp_path / f"logs/node{i}.log").read_text() for i in (0, 1))
    assert "rank 2 (and rank 3) stopped responding" in node0, node0[-3000:]
    assert "cannot reach the job's store" in node1, node1[-3000:]

    run, left = emulated(command, tmp_path, "--inter-node-bandwidth", "200mbit")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert left == [], left
    # node 0's output streams to the terminal; every node's is kept in its own file, and the
    # training log (megatron prints on the last rank) is in node 1's
    assert run.stdout.startswith("emulated_cluster: 2 nodes x 2 ranks")
    assert "iteration" in (tmp_path / "logs/node1.log").read_text()
    assert f"resumed from {ckpt} at iteration 3" in run.stdout  # rank 0's line
    rows = json.loads(losses_json.read_text())
    assert [row["iteration"] for row in rows] == list(range(1, 9))
    got, want = [row["lm loss"] for row in rows], single.loss()
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-5, (got, want)


@pytest.mark.parametrize("repeat", range(int(os.environ.get("PARM_STOP_REPEATS", "1"))))
def test_a_node_stopped_from_outside_ends_the_job_with_one_line(gpt_data, tmp_path, repeat):
    """Node 1's ranks (2 and 3) stopped with SIGSTOP from outside after a random iteration
    (TP2 x EP2 x ESP2 + SP, saving every 4, --distributed-timeout-minutes 0.5 and
    --watchdog-timeout-minutes 0.25): node 0's watchdog names them at 15 s, before gloo's own
    30 s; node 1's launcher ends them (SIGKILL) when they have been
    stopped for longer than the watchdog's limit; every rank ends within 40 s, one error line
    in the whole job, no traceback."""
    after = random.Random().randint(2, 9)
    flags = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
             "expert-tensor-parallel-size": 2, "sequence-parallel": True, "train-iters": 60,
             "save-interval": 4, "distributed-timeout-minutes": 0.5,
             "watchdog-timeout-minutes": 0.25, "log-interval": 1}
    command = ["pretrain_gpt_moe.py", *tiny_gpt_args(gpt_data, **flags, save=tmp_path / "c")]
    start = time.monotonic()
    run, left = emulated(command, tmp_path, "--inter-node-bandwidth", "200mbit",
                         "--stop-node-at", f"iteration {after:6d}/", served=False)
    took = time.monotonic() - start
    output = run.stdout + run.stderr
    stop = re.search(r"stopped node 1's ranks \[2, 3\] \(SIGSTOP\) ([0-9.]+) s after", output)
    assert stop and run.returncode != 0 and left == [], output[-3000:]
    assert took - float(stop[1]) <= 40, (took, stop[1], output[-3000:])
    logs = "".join((tmp_path / f"logs/node{i}.log").read_text() for i in (0, 1))
    errors = [line for line in logs.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and re.search(r"rank [23] \(and rank [23]\) stopped responding",
                                          errors[0]), logs[-3000:]
    assert "Traceback" not in logs, logs[-3000:]
    assert "were ended with SIGKILL" in (tmp_path / "logs/node1.log").read_text()
    print(f"\nnode 1 stopped after iteration {after}, every rank ended "
          f"{took - float(stop[1]):.1f} s later: {errors[0]}")


def test_failing_command_leaves_nothing_behind(tmp_path):
    """Node 1 fails; node 0 first shows what its namespace was given: the shaped link and TCP
    settings that fill it (reno, no slow start after idle)."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, subprocess, sys\n"
        "if os.environ['NODE_RANK'] == '1':\n    sys.exit(3)\n"
        "if os.environ['LOCAL_RANK'] == '0':\n"
        "    show = 'sysctl -n net.ipv4.tcp_congestion_control net.ipv4.tcp_slow_start_after_idle;'\n"
        "    print(subprocess.run(show + ' tc qdisc show', shell=True, capture_output=True,\n"
        "                         text=True).stdout, flush=True)\n")
    run, left = emulated([str(script)], tmp_path, "--inter-node-bandwidth", "200mbit",
                         "--grace", "3", timeout=120)  # node 0 waits at torchrun's end
    assert run.returncode != 0
    assert "node 1 exited" in run.stderr
    assert left == [], left
    shown = (tmp_path / "logs/node0.log").read_text()
    assert "reno\n0\n" in shown and "tbf" in shown and "rate 200Mbit" in shown, shown


def test_bad_requests_are_refused(tmp_path):
    run, left = emulated(["x.py"], tmp_path, "--inter-node-bandwidth", "fast", timeout=60)
    assert run.returncode == 2 and "--inter-node-bandwidth 'fast'" in run.stderr
    run, left = emulated([], tmp_path, timeout=60)
    assert run.returncode == 2 and "give the command after --" in run.stderr
    assert left == []


def test_signals_during_teardown_do_not_cut_it_short(tmp_path):
    """Stopped with SIGTERM and, at once, SIGTERM and Ctrl-C again (as `pkill` matching the
    tool twice does): the first signal starts the teardown, the others must not interrupt it."""
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(120)\n")
    tool = subprocess.Popen([sys.executable, str(TOOL), "--nodes", "2", "--procs-per-node", "1",
                             "--log-dir", str(tmp_path / "logs"), "--master-port",
                             str(free_port()), "--", str(script)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert tool.stdout.readline().startswith("emulated_cluster: 2 nodes x 1 ranks")
    for signum in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):  # the last two mid-teardown
        tool.send_signal(signum)
        time.sleep(0.2)
    _, err = tool.communicate(timeout=60)
    assert tool.returncode == 130, err
    assert "interrupted; removed the emulated cluster" in err
    assert _leftovers(default_tag(tool.pid)) == []
