"""torchrun for the tests, with ranks that start in milliseconds instead of seconds.

    python tests/torchrun_server.py SOCKET      (started by conftest.torchrun, once a session)

A rank of a plain `torchrun ... pretrain_gpt_moe.py` spends about 3 s of CPU importing torch,
megatron-core and the project before it reads a flag: 80 % of a 5-iteration test run, paid by
every rank of every launch (4 ranks share 2 cores here). This server imports them once. Each
launch asked of it is a process forked from the server that runs torchrun's own main with
torchrun's own `--run-path --start-method fork`: the same argument parsing, elastic agent,
rendezvous, restarts and failure summary, the script run by runpy in ranks the agent forks,
instead of in a fresh Python that imports everything again. What the ranks run is the project's
code as a user's launch runs it; only the imports happened before the fork.

Protocol, one connection per launch: the client sends one JSON line {"argv": torchrun's
arguments, "env": the environment, "cwd": ..., "output": a file for stdout and stderr}; or,
for `python SCRIPT ARGS` (conftest.python: a tool, the imports made already), {"python":
[SCRIPT, *ARGS], ..., "error": a file for stderr apart}; or, for `python -m MODULE ARGS`
(tests/launch_client.py: the torchrun wrapper scripts/launch.sh runs), {"module": [MODULE,
*ARGS], ...} with the client's stdin, stdout and stderr passed along the socket (SCM_RIGHTS)
instead of files, and its network and mount namespaces, which the launch joins. The server
answers a line with the launch's process id (its own process group: kill the group to stop
every rank), then, when it ends, a line with its exit status (negative: the signal). A
client that goes away first takes the launch with it (SIGKILL to its process group).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading

from parm_trainer.lazy_imports import asks_for_wandb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = ("pretrain_gpt_moe.py", "pretrain_bert_moe.py", "tools/generate.py",
           "tools/bench_moe_layer.py")


def preload() -> None:
    """Import what the entry points import (their top level, not their main), torch._dynamo,
    which torch's Adam imports on construction, and what the converters import."""
    sys.path[0] = ROOT
    sys.argv = ["preload"]  # no --wandb-project: the entry points leave wandb unimported
    for script in PRELOAD:
        runpy.run_path(os.path.join(ROOT, script), run_name="__preload__")
    import torch._dynamo  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import parm_trainer.cluster.torchrun_job  # noqa: F401 (scripts/launch.sh's, launch_client.py)
    # what the converters' processes (conftest.python) build
    from transformers import BertForPreTraining, MixtralForCausalLM, Qwen2MoeForCausalLM  # noqa
    import parm_trainer.convert.hf  # noqa: F401


def freeze_the_imports() -> None:
    """The preloaded modules' objects out of the garbage collector's reach (gc.freeze, as
    Python's documentation advises before forking): a forked rank's collections (the trainer's
    own at start-up, manual_gc.freeze_startup, and every full one after) would otherwise walk
    them all, writing to each object's header and so copying every page of the server's heap
    into the rank. 9 four-rank launches of test_training_layouts: 84.2-85.0 -> 68.9-74.9
    core-s."""
    import gc

    gc.collect()
    gc.freeze()


# A rank that has not made its store client (the first step of init_process_group) after this
# long says so and exits with this status, and conftest.torchrun runs the launch once more.
RENDEZVOUS_HANG_S = 30.0
RENDEZVOUS_HUNG = "torchrun_server: this rank's rendezvous hung"
RENDEZVOUS_HUNG_EXIT = 75


def watch_rendezvous() -> None:
    """Ranks forked from torchrun's agent (start-method fork, which only this launcher uses; a
    plain torchrun spawns them) inherit a process whose other threads were running, the agent's
    store server among them; rarely (1 launch in about 200 of a 4-rank test) a rank then hangs
    making its client of that store, at init_process_group, while the others wait for it in
    gloo's connect. Each rank forked from here watches that step, in both places a store client
    is made (torch's env:// rendezvous, and parallel._attempt_store, the project's own under
    torchrun): past RENDEZVOUS_HANG_S it prints RENDEZVOUS_HUNG and exits, so the launch fails
    at once instead of at its timeout, with nothing of the test's script run beyond its store.
    PARM_TEST_RENDEZVOUS_HANG_S in a launch's environment sets the limit (0: hung at once)."""
    import importlib

    from parm_trainer import parallel

    def hung() -> None:
        os.write(2, f"\n{RENDEZVOUS_HUNG}\n".encode())
        os._exit(RENDEZVOUS_HUNG_EXIT)

    def watch(owner, name: str) -> None:
        create = getattr(owner, name)

        def watched(*args, **kwargs):
            limit = float(os.environ.get("PARM_TEST_RENDEZVOUS_HANG_S", RENDEZVOUS_HANG_S))
            if limit <= 0:  # the tests of this path: every rank reports a hang at once
                hung()
            timer = threading.Timer(limit, hung)
            timer.daemon = True
            timer.start()
            try:
                return create(*args, **kwargs)
            finally:
                timer.cancel()

        setattr(owner, name, watched)

    # the module torch.distributed.rendezvous, not the function of that name in torch.distributed
    watch(importlib.import_module("torch.distributed.rendezvous"), "_create_c10d_store")
    watch(parallel, "_attempt_store")


def ranks_start_with_fresh_signals() -> None:
    """A rank forked from torchrun's agent inherits the agent's Python handlers of SIGTERM,
    SIGINT, SIGHUP and SIGQUIT, which act only once the rank's main thread is back in Python:
    a rank blocked in a collective then outlives the agent's SIGTERM by its 30 s grace. A rank
    of a plain torchrun is a fresh Python and dies at once; so does each rank forked from here
    (what the project installs itself, --exit-signal-handler, comes after)."""
    from torch.distributed import run

    as_script = run.run_script_path

    def fresh(*args):
        for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return as_script(*args)

    run.run_script_path = fresh


def ranks_may_end_with_os_exit() -> None:
    """A script may end its ranks with os._exit(0) once its work is done (the bench tools do,
    bench/layout.leave, to skip megatron's slow teardown of its process groups): a plain
    torchrun's rank is a process, and its exit status is all the agent reads. A rank forked by
    the agent runs a function whose return value it hands to the agent on a queue, and the agent
    waits for every rank's value before it ends the launch: a rank that left by os._exit(0)
    would keep it waiting forever. Here such a rank hands in its value (None) first, waits until
    the agent has read every rank's, and then exits as it asked. A process the rank forks
    (megatron's checkpoint writers end with os._exit too) exits at once: it is not the rank."""
    from torch.distributed.elastic.multiprocessing import api

    wrap = api._wrap

    def wrapped(local_rank, fn, args, envs, stdout, stderr, ret_vals, read_event, *rest):
        exit_, rank_pid = os._exit, os.getpid()

        def exit_with_value(status):
            if status == 0 and os.getpid() == rank_pid:
                ret_vals[local_rank].put(None)
                read_event.wait()
            exit_(status)

        os._exit = exit_with_value
        return wrap(local_rank, fn, args, envs, stdout, stderr, ret_vals, read_event, *rest)

    api._wrap = wrapped


def run_python(argv: list) -> None:
    """`python SCRIPT ARGS` in this process: the script run as __main__ with its folder first
    on sys.path, as a fresh Python runs it."""
    sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def run_module(argv: list) -> None:
    """`python -m MODULE ARGS` in this process, the working directory first on sys.path."""
    sys.argv, sys.path[0] = list(argv), os.getcwd()
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


def _redirect(request: dict, fds: list) -> None:
    """stdout and stderr to the request's files, or stdin, stdout and stderr to the client's."""
    if fds:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        return
    fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if "error" in request:  # stderr apart
        fd = os.open(request["error"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.close(fd)


def join_namespaces(fds: list) -> None:
    """Into the client's network and mount namespaces (launch_client.NAMESPACES' order), where
    they are not this process's: the launch of an emulated node (`ip netns exec`) on its link.
    A forked child is single-threaded, as joining a mount namespace needs."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for fd, (kind, flag) in zip(fds, (("net", 0x40000000), ("mnt", 0x00020000))):
        if os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino \
                and libc.setns(fd, flag) != 0:  # CLONE_NEWNET, CLONE_NEWNS
            raise OSError(ctypes.get_errno(), f"setns into the client's {kind} namespace")
        os.close(fd)


def run_launch(request: dict, fds: list) -> None:
    """In the forked child: become the launch (its own process group, environment, directory
    and output), then torchrun's main, or with "python" or "module" that command; never
    returns."""
    status = 1
    try:
        atexit._clear()  # a fresh Python has none; the script's own (process_exit.end runs them)
        os.setsid()
        join_namespaces(fds[3:])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _redirect(request, fds[:3])
        argv = request.get("argv") or request.get("python") or request["module"]
        if asks_for_wandb(argv) and "wandb" in sys.modules \
                and sys.modules["wandb"] is None:  # the preload's skip_wandb_unless_asked
            del sys.modules["wandb"]  # this run logs to wandb: let it import it
        if "python" in request:
            run_python(request["python"])
        elif "module" in request:
            run_module(request["module"])
        else:
            from torch.distributed.run import main

            main(["--run-path", "--start-method", "fork", *argv])
        status = 0
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            status = stop.code or 0
        else:  # sys.exit("message"): printed, status 1, as Python does
            print(stop.code, file=sys.stderr)
    except BaseException:  # torchrun's main has printed what failed (its @record)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def read_request(connection) -> tuple:
    """(the request, the file descriptors that came with it)."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 5)
    while not data.endswith(b"\n"):
        more = connection.recv(1 << 16)
        if not more:
            break
        data += more
    return json.loads(data), fds


def _receives(connection) -> bool:
    """Whether a client's connection is still open (a client sends nothing after its request)."""
    try:
        return bool(connection.recv(1))
    except OSError:
        return False


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    running = {}  # pid -> the connection waiting for its status
    parent = os.getppid()
    while os.getppid() == parent:  # a test session killed outright leaves no server behind
        readable, _, _ = select.select([listener, *running.values()], [], [], 0.05)
        if listener in readable:
            connection, _ = listener.accept()
            request, fds = read_request(connection)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                for held in (listener, connection, *running.values()):
                    held.close()
                run_launch(request, fds)
            for fd in fds:
                os.close(fd)
            connection.sendall(f"{pid}\n".encode())
            running[pid] = connection
        for pid, connection in list(running.items()):
            if connection in readable and not _receives(connection):  # the client went away
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                connection = running.pop(pid)
                try:
                    connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:  # the client gave up (its timeout)
                    pass
                connection.close()


if __name__ == "__main__":
    socket_path = sys.argv[1]
    preload()
    freeze_the_imports()
    watch_rendezvous()
    ranks_start_with_fresh_signals()
    ranks_may_end_with_os_exit()
    serve(socket_path)
