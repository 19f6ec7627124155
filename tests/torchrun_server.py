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
arguments, "env": the environment, "cwd": ..., "output": a file for stdout and stderr}; the
server answers a line with the launch's process id (its own process group: kill the group to
stop every rank), then, when it ends, a line with its exit status (negative: the signal).
"""

from __future__ import annotations

import json
import os
import runpy
import select
import socket
import sys

from parm_trainer.lazy_imports import asks_for_wandb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = ("pretrain_gpt_moe.py", "pretrain_bert_moe.py", "tools/generate.py")


def preload() -> None:
    """Import what the entry points import (their top level, not their main), and torch._dynamo,
    which torch's Adam imports on construction."""
    sys.path[0] = ROOT
    sys.argv = ["preload"]  # no --wandb-project: the entry points leave wandb unimported
    for script in PRELOAD:
        runpy.run_path(os.path.join(ROOT, script), run_name="__preload__")
    import torch._dynamo  # noqa: F401
    import torch.distributed.run  # noqa: F401


def run_launch(request: dict) -> None:
    """In the forked child: become the launch (its own process group, environment, directory
    and output), then torchrun's main; never returns."""
    status = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        if asks_for_wandb(request["argv"]) and "wandb" in sys.modules \
                and sys.modules["wandb"] is None:  # the preload's skip_wandb_unless_asked
            del sys.modules["wandb"]  # this run logs to wandb: let it import it
        from torch.distributed.run import main

        main(["--run-path", "--start-method", "fork", *request["argv"]])
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # torchrun's main has printed what failed (its @record)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    running = {}  # pid -> the connection waiting for its status
    parent = os.getppid()
    while os.getppid() == parent:  # a test session killed outright leaves no server behind
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            connection, _ = listener.accept()
            request = json.loads(connection.makefile().readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                run_launch(request)
            connection.sendall(f"{pid}\n".encode())
            running[pid] = connection
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
    serve(socket_path)
