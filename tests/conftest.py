"""Shared fixtures: a small real dataset built with the project's own tools, and a launcher
that runs pretrain_gpt_moe.py under torchrun and reads back its per-iteration losses."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import re
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from torchrun_server import RENDEZVOUS_HUNG

# fixtures kept in modules of their own: the data sets, what the bad-input tests share, and
# how the tests share the machine under pytest -n
pytest_plugins = ["data_fixtures", "bad_input_fixtures", "world_fixtures", "sharing_fixtures",
                  "cpu_per_test"]

ROOT = Path(__file__).resolve().parents[1]
# auto's start-up measurements (parm_trainer/schedule/tune.py) in one cache for the whole
# session, both workers of pytest -n included (the controller's pid names it): a layer is
# measured once a session (tune's cache lock: a layer two workers measured at once keeps the
# first entry, used by both), runs that are compared make the same choice, and the user's own
# cache is never touched (every process the tests start inherits the variable). The session's
# first process, the controller under pytest -n, removes it at the end.
_SESSION = os.getppid() if "PYTEST_XDIST_WORKER" in os.environ else os.getpid()
os.environ["PARM_TRAINER_CACHE_DIR"] = f"/tmp/parm_trainer_test_cache_{_SESSION}"


def pytest_sessionfinish(session):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(os.environ["PARM_TRAINER_CACHE_DIR"], ignore_errors=True)


def run_tool(*args, timeout=300):
    result = python(*args, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def load_module(path, name):
    """A script of the repository (a tool, an entry point) as a module, to call its main."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel handed out for
    this (bind to 0) may next be the local end of another process's outgoing connection (the
    gloo meshes of the launches beside this test's, under pytest -n) before the launch binds
    it. Drawn at random, so two workers rarely draw one."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    draw = random.Random()  # not the tests' seeded generators
    for _ in range(100):
        port = draw.randrange(max(1024, ephemeral - 12000), ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float
    losses: list

    def loss(self, name="lm loss"):
        return [row[name] for row in self.losses]


def tiny_gpt_args(data, **overrides) -> list:
    """A tiny MoE GPT that trains a step in well under a second per rank."""
    flags = {
        "num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64,
        "max-position-embeddings": 64, "num-experts": 4, "moe-router-topk": 2,
        "micro-batch-size": 2, "global-batch-size": 8, "lr": 1e-3, "lr-warmup-iters": 0,
        "train-iters": 5, "log-interval": 1, "eval-interval": 1000, "eval-iters": 1,
        "hidden-dropout": 0.0, "attention-dropout": 0.0, "split": "90,5,5",
        "data-path": data["prefix"], "tokenizer-model": data["tokenizer"], "seed": 1234,
    }
    flags.update(overrides)
    args = [] if flags.pop("bias-linear", False) else ["--disable-bias-linear"]
    for key, value in flags.items():
        if value is None:
            continue
        args.append(f"--{key}")
        if value is not True:
            args.append(str(value))
    return args


# PYTHONFAULTHANDLER: a rank that gets SIGABRT prints every thread's Python stack first (what
# a launch past its timeout is sent before it is killed, so that a hang says where it hung)
LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
_SERVER = {}
RERUN_NOTE = "conftest.torchrun: a rank's rendezvous hung; the launch once more:"


def _torchrun_server():
    """tests/torchrun_server.py, started on the first launch, stopped with the session."""
    if "socket" not in _SERVER:
        path = f"/tmp/parm_torchrun_{os.getpid()}.sock"
        process = subprocess.Popen(
            [sys.executable, "tests/torchrun_server.py", path], cwd=ROOT, stdout=subprocess.PIPE,
            text=True, env={**os.environ, **LAUNCH_ENV, "PYTHONUNBUFFERED": "1"})
        assert process.stdout.readline().strip() == "ready", "the torchrun server did not start"
        _SERVER.update(socket=path, process=process)
    return _SERVER["socket"]


@pytest.fixture(scope="session", autouse=True)
def _stop_torchrun_server():
    yield
    Path(f"/tmp/parm_launch_python_{os.getpid()}").unlink(missing_ok=True)
    if "process" in _SERVER:
        _SERVER["process"].kill()
        _SERVER["process"].wait()
        os.unlink(_SERVER["socket"])


def _abort_one_by_one(group: int) -> None:
    """SIGABRT to every rank of a launch (process group `group`, led by torchrun's agent), one at
    a time, so that each prints its stacks (PYTHONFAULTHANDLER) without interleaving another's;
    the agent is stopped first, or it would end the other ranks when the first one dies."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(group, signal.SIGSTOP)
    ranks = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) == group and int(entry) != group:
                ranks.append(int(entry))  # field 5 of stat: the process group
    for rank in sorted(ranks):
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank, signal.SIGABRT)
        time.sleep(0.3)


def torchrun(argv: list, env: dict = None, timeout: float = 300, real: bool = False) -> tuple:
    """`torchrun ARGV` in ROOT: (exit status, stdout and stderr together). Through
    tests/torchrun_server.py (torchrun's --run-path --start-method fork, from a process that
    imported torch and megatron-core once); with `real` or PARM_TEST_REAL_TORCHRUN=1, the real
    command. A launch past `timeout` is killed, every rank with it, and fails the test with
    the end of its output, where each rank has printed its stacks (SIGABRT first, to
    each in turn). A launch where a rank's rendezvous hung (torchrun_server.watch_rendezvous:
    the forked ranks' own hazard) runs once more."""
    env = {**os.environ, **LAUNCH_ENV, **(env or {})}
    argv = [str(a) for a in argv]
    if real or os.environ.get("PARM_TEST_REAL_TORCHRUN") == "1":
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv], cwd=ROOT,
                                capture_output=True, text=True, timeout=timeout, env=env)
        return result.returncode, result.stdout + result.stderr
    return once_more_if_hung(lambda: _served_launch(argv, env, timeout))


def once_more_if_hung(launch, may=lambda text: True) -> tuple:
    """launch() -> (status, output), once more where a forked rank's rendezvous hung and
    may(output) allows it (torchrun_server.watch_rendezvous); both outputs kept."""
    status, text = launch()
    if RENDEZVOUS_HUNG in text and may(text):
        status, again = launch()
        text = f"{text}\n{RERUN_NOTE}\n{again}"
    return status, text


def _served_launch(argv: list, env: dict, timeout: float) -> tuple:
    status, text, _ = _served({"argv": argv}, env, timeout)
    if status is None:
        pytest.fail(f"torchrun {' '.join(argv)}: past its {timeout} s, killed; its output "
                    f"(each rank's stacks at the end):\n{text[-30000:]}")
    return status, text


def _served(request: dict, env: dict, timeout: float, stderr_apart: bool = False) -> tuple:
    """(exit status or None past `timeout`, stdout with stderr (stdout alone with
    stderr_apart), stderr with stderr_apart else "") of one request to
    tests/torchrun_server.py."""
    stem = f"/tmp/parm_torchrun_{os.getpid()}_{time.monotonic_ns()}"
    files = {"output": Path(f"{stem}.log")}
    if stderr_apart:
        files["error"] = Path(f"{stem}.err")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(_torchrun_server())
        client.sendall((json.dumps({**request, "env": env, "cwd": str(ROOT),
                                    **{k: str(v) for k, v in files.items()}}) + "\n").encode())
        replies = client.makefile()
        pid = int(replies.readline())
        client.settimeout(timeout)
        try:
            status = int(replies.readline())
        except TimeoutError:
            status = None
            _abort_one_by_one(pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    texts = {k: f.read_text(errors="replace") for k, f in files.items()}
    for f in files.values():
        f.unlink()
    return status, texts["output"], texts.get("error", "")


def python(*argv, env: dict = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` in ROOT as subprocess.run(..., capture_output=True, text=True)
    gives it, run by a process forked from
    tests/torchrun_server.py, which has imported torch, megatron-core and the project once
    (about 3 s of CPU a fresh Python spends). Not for a test of what a fresh interpreter
    imports or patches: that one starts its own."""
    argv = [str(a) for a in argv]
    status, out, err = _served({"python": argv}, {**os.environ, **(env or {})}, timeout,
                               stderr_apart=True)
    if status is None:
        pytest.fail(f"python {' '.join(argv)[:300]}: past its {timeout} s, killed:\n{err[-3000:]}")
    return subprocess.CompletedProcess(["python", *argv], status, out, err)


def launch(nproc: int, args: list, tmp_path: Path, timeout: float = 300,
           script: str = "pretrain_gpt_moe.py", env: dict = None, real: bool = False) -> Run:
    losses_json = tmp_path / f"losses_{time.monotonic_ns()}.json"
    argv = ["--nproc-per-node", nproc, "--master-port", free_port(), script, *args,
            "--log-losses-json", losses_json]
    start = time.monotonic()
    status, output = torchrun(argv, env, timeout, real)
    seconds = time.monotonic() - start
    losses = json.loads(losses_json.read_text()) if losses_json.exists() else []
    return Run(status, output, seconds, losses)


def served_env(python: bool = True) -> dict:
    """The environment sending launch.sh's wrapper (PYTHON, unless not `python`) and the tools'
    torchrun (PARM_TORCHRUN) to the server by launch_client.py; none at PARM_TEST_REAL_TORCHRUN=1"""
    if os.environ.get("PARM_TEST_REAL_TORCHRUN") == "1":
        return {}
    client = Path(f"/tmp/parm_launch_python_{os.getpid()}")
    if not client.exists():  # launch.sh runs "$PYTHON": one executable path
        client.write_text(f"#!/bin/sh\nexec '{sys.executable}' '{ROOT}/tests/launch_client.py' "
                          '"$@"\n')
        client.chmod(0o755)
    env = {"PARM_TORCHRUN": f"{client} -m torch.distributed.run",
           "PARM_TEST_TORCHRUN_SOCKET": _torchrun_server()}
    return {**env, "PYTHON": str(client)} if python else env


def _launch_sh_env(nproc: int, env: dict, real: bool) -> dict:
    """The environment of `bash scripts/launch.sh` on nproc ranks: served (served_env) unless
    `real` (a fresh Python for the wrapper and each rank: torchrun's own failure report)."""
    return {**os.environ, **LAUNCH_ENV, "NPROC_PER_NODE": str(nproc),
            "MASTER_PORT": str(free_port()), **(env or {}), **({} if real else served_env())}


def launch_sh(nproc: int, args: list, env: dict = None, timeout: float = 120,
              script: str = "pretrain_gpt_moe.py", real: bool = False) -> Run:
    """`bash scripts/launch.sh SCRIPT ARGS` on nproc local ranks, as a user runs a job: its
    output as a terminal shows it (stdout and stderr in one stream); once_more_if_hung."""
    started = []  # of each attempt: the run's seconds are its last one's

    def once() -> tuple:
        started.append(time.monotonic())
        result = subprocess.run(["bash", "scripts/launch.sh", script, *map(str, args)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, timeout=timeout, env=_launch_sh_env(nproc, env, real))
        return result.returncode, result.stdout

    status, output = once_more_if_hung(once)
    return Run(status, output, time.monotonic() - started[-1], [])


def launch_sh_until(nproc: int, args: list, pattern: str = None, then=None,
                    timeout: float = 300, env: dict = None, real: bool = False):
    """scripts/launch.sh on nproc ranks, its output read as it comes: at the first line matching
    `pattern`, then(match, the launcher (signals to it reach torchrun's wrapper), its ranks in
    local-rank order); (exit status, the whole output). A launch where a rank's rendezvous hung
    before the pattern came runs once more."""
    return once_more_if_hung(
        lambda: _launch_sh_until(nproc, args, pattern, then, timeout, env, real),
        may=lambda text: not (pattern and re.search(pattern, text, re.M)))


def _launch_sh_until(nproc, args, pattern, then, timeout, env, real) -> tuple:
    pid_file = Path(f"/tmp/parm_launch_pid_{os.getpid()}_{time.monotonic_ns()}")
    env = {**_launch_sh_env(nproc, env, real), "PYTHONUNBUFFERED": "1",
           "PARM_TEST_LAUNCH_PID_FILE": str(pid_file)}
    job = subprocess.Popen(["bash", "scripts/launch.sh", "pretrain_gpt_moe.py", *map(str, args)],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=env, start_new_session=True)
    lines, matched, deadline = [], None, time.monotonic() + timeout
    try:
        for line in _lines_until_the_end(job, deadline):
            lines.append(line)
            if pattern and matched is None and (matched := re.search(pattern, line)):
                launcher = psutil.Process(job.pid)  # launch.sh execs the wrapper or its client
                then(matched, launcher, _ranks(launcher, pid_file))
        job.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:  # the ranks too (its process group), not only the launcher, past the timeout
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # a served launch: the server ends it
        job.wait()
        pid_file.unlink(missing_ok=True)
    return job.returncode, "".join(lines)


def _ranks(launcher, pid_file: Path) -> list:
    """The launch's ranks in local-rank order: a served launch's are its wrapper's children in
    the order they were forked (torchrun forks them rank by rank; their environment in /proc is
    the server's), a real one's read from theirs."""
    if pid_file.exists():
        return sorted(psutil.Process(int(pid_file.read_text())).children(),
                      key=lambda rank: rank.pid)
    ranks = [rank for rank in launcher.children()
             if "pretrain_gpt_moe.py" in " ".join(rank.cmdline())]
    return sorted(ranks, key=lambda rank: int(rank.environ()["LOCAL_RANK"]))


def _lines_until_the_end(job, deadline: float, after_exit_s: float = 10.0):
    """The lines of job's output as they come, until it ends and its output does (or a process
    it left behind has kept the output open `after_exit_s` past its end: the test goes on and
    its checks say what is wrong), or until `deadline`."""
    import queue
    import threading

    lines = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, job.stdout), lines.put(None)],
                     daemon=True).start()
    ended = None
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if job.poll() is not None:
                ended = ended or time.monotonic()
                if time.monotonic() - ended > after_exit_s:
                    return
            continue
        if line is None:
            return
        yield line


def last_line(output: str) -> str:
    return next(line for line in reversed(output.splitlines()) if line.strip())


def run_rank_workers(tmp_path: Path, worker: str, nproc: int, timeout: float) -> list:
    """Run tests/<worker> (a worker_*.py module ending in rank_main.run) on nproc ranks
    (argv[1]: tmp_path, where each rank writes rank<R>.json {"rank", "checks", "failures"}
    and, if it hangs, its threads' stacks to stacks<R>.txt); fail on a hang, on any rank's
    failures or a non-zero exit; return the reports, by rank."""
    script = ROOT / "tests" / worker
    status, output = torchrun(["--nproc-per-node", nproc, "--master-port", free_port(), script,
                               tmp_path], timeout=timeout)
    stacks = "".join(path.read_text() for path in sorted(tmp_path.glob("stacks*.txt")))
    assert not stacks, f"a rank hung; its threads:\n{stacks[-8000:]}"
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    failures = {r["rank"]: [f[-1500:] for f in r["failures"][:5]] for r in reports
                if r["failures"]}
    assert not failures, json.dumps(failures, indent=1)
    assert status == 0, output[-4000:]
    return reports


def max_relative(got, expected) -> float:
    """Largest relative difference between two equally long lists of numbers."""
    return max(abs(x - y) / abs(y) for x, y in zip(got, expected))


LAUNCH_LIMIT_S = 30  # bad input must end every rank well within this


def error_lines(output: str) -> list:
    return [line for line in output.splitlines() if line.startswith("error")]


def assert_clean_failure(run: Run, *needles):
    """Bad input: non-zero exit, fast, an `error...` line naming each needle, no traceback."""
    assert run.returncode != 0, run.output[-3000:]
    assert run.seconds < LAUNCH_LIMIT_S, f"took {run.seconds:.1f}s"
    lines = error_lines(run.output)
    assert lines, run.output[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    # torchrun prints its own summary; the ranks themselves print no traceback
    assert "]: Traceback" not in run.output, run.output[-3000:]


# --- the `launches` marker: tests that start processes, found from their code -------------------
#
# A test launches where its body, a helper of its module it calls (at any depth), or a fixture it
# uses calls one of conftest's launchers or a subprocess function. `make test-fast` runs the
# others (pytest -m "not launches").

LAUNCHERS = {"launch", "torchrun", "launch_sh", "launch_sh_until", "run_rank_workers", "run_tool",
             "python"}
_LAUNCHING: dict = {}  # module file -> names of its functions that launch


def _called(node) -> set:
    """Names a function's body calls: f(...) as "f", subprocess.X(...) as "subprocess"."""
    import ast

    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            if isinstance(call.func, ast.Name):
                names.add(call.func.id)
            elif isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name):
                names.add(call.func.value.id if call.func.value.id == "subprocess"
                          else call.func.attr)
    return names


def _launching(path: str) -> set:
    """The module's functions that launch (fixed point over its own helpers), and the names it
    imports from other test modules that launch there."""
    import ast

    if path not in _LAUNCHING:
        _LAUNCHING[path] = set()  # a cycle of imports between test modules ends here
        tree = ast.parse(Path(path).read_text())
        known = set(LAUNCHERS) | {"subprocess"}
        for node in tree.body:  # helpers imported from another test module
            if isinstance(node, ast.ImportFrom) and node.module and \
                    (ROOT / "tests" / f"{node.module}.py").exists():
                known |= {a.asname or a.name for a in node.names} & \
                    _launching(str(ROOT / "tests" / f"{node.module}.py"))
        functions = {n.name: _called(n) for n in tree.body
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        found, grew = set(), True
        while grew:
            grew = False
            for name, calls in functions.items():
                if name not in found and calls & (known | found):
                    found.add(name)
                    grew = True
        _LAUNCHING[path] = found | (known - LAUNCHERS - {"subprocess"})
    return _LAUNCHING[path]


def _function_launches(function) -> bool:
    import inspect

    function = inspect.unwrap(function)
    path = inspect.getsourcefile(function)
    return bool(path) and path.startswith(str(ROOT / "tests")) and \
        function.__name__ in _launching(path)


def pytest_configure(config):
    config.addinivalue_line("markers", "launches: starts processes (found from the test's code; "
                                       "make test-fast leaves these out)")


@pytest.fixture(autouse=True)
def _megatron_loss_trackers_cleared():
    """megatron-core's MoE and MTP loss trackers are process globals sized by the first model
    that logs into them: a test's model of more layers would index past an earlier test's."""
    yield
    if "megatron.core.transformer.moe.moe_utils" in sys.modules:
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        moe_utils.get_moe_layer_wise_logging_tracker().clear()
        MTPLossLoggingHelper.tracker.clear()


def pytest_collection_modifyitems(items):
    """Mark the tests that start processes; then order the session longest first, as far as
    the markers tell: the tests of the machine's shared state (a minute or more each, never
    two of a kind at once), then the other launches, then the in-process tests, which fill
    the cores at the end instead of leaving one idle while the other ends a long test. The
    `alone` tests come last: earlier, their worker sat idle until the other's test ended
    (22-27 s a session); at the end the other worker is done or nearly."""
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = fixtures.name2fixturedefs.values() if fixtures else ()
        if _function_launches(item.function) or any(_function_launches(d[-1].func)
                                                    for d in defs if d):
            item.add_marker(pytest.mark.launches)
    items.sort(key=lambda item: (item.get_closest_marker("alone") is not None,
                                 item.get_closest_marker("one_at_a_time") is None,
                                 item.get_closest_marker("launches") is None))
