"""The Python that scripts/launch.sh runs in the tests (its PYTHON), and the tools' torchrun
(PARM_TORCHRUN, `launch_client -m torch.distributed.run`): `-m
parm_trainer.cluster.torchrun_job ARGS` or `-m torch.distributed.run ARGS` asked of
tests/torchrun_server.py, which runs it in a process forked from itself (torch and
megatron-core imported once) with this process's stdin, stdout and stderr, and torchrun forks
the ranks (--run-path --start-method fork) instead of starting a fresh Python for each, about
5 s of CPU apiece. launch.sh's own part (its checks, the environment read into torchrun's
flags) and the tools' run as a user's do.

This process stands for the launcher: the signals it gets go on to the wrapper, it ends with
the wrapper's status (a signal as that signal), and where it is killed the server ends the
launch, which runs in this process's network and mount namespaces (an emulated node's).
PARM_TEST_LAUNCH_PID_FILE, where set, gets the wrapper's process id (its ranks are its
children). Only the standard library: it starts in milliseconds.
"""

import contextlib
import json
import os
import signal
import socket
import sys

WRAPPER, TORCHRUN = "parm_trainer.cluster.torchrun_job", "torch.distributed.run"
NAMESPACES = ("net", "mnt")  # the order tests/torchrun_server.py joins them in
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


@contextlib.contextmanager
def namespaces():
    """This process's network and mount namespaces (open files), which the launch joins: a
    client started in an emulated node (`ip netns exec`) gets ranks on that node's link."""
    fds = [os.open(f"/proc/self/ns/{kind}", os.O_RDONLY) for kind in NAMESPACES]
    try:
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def main(argv: list) -> int:
    if argv[:1] != ["-m"] or argv[1:2] not in ([WRAPPER], [TORCHRUN]):
        print(f"launch_client.py: only `-m {WRAPPER}|{TORCHRUN} ARGS`, not {argv[:2]}",
              file=sys.stderr)
        return 2
    # torchrun: the server's own call of its main (with --run-path --start-method fork); the
    # wrapper: run as `python -m` runs it, torchrun's arguments told the same
    request = {"argv": argv[2:]} if argv[1] == TORCHRUN else \
        {"module": [WRAPPER, "--run-path", "--start-method", "fork", *argv[2:]]}
    request.update(env=dict(os.environ), cwd=os.getcwd())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.connect(os.environ["PARM_TEST_TORCHRUN_SOCKET"])
        with namespaces() as joined:
            socket.send_fds(server, [(json.dumps(request) + "\n").encode()], [0, 1, 2, *joined])
        replies = server.makefile()
        pid = int(replies.readline())
        if os.environ.get("PARM_TEST_LAUNCH_PID_FILE"):
            with open(os.environ["PARM_TEST_LAUNCH_PID_FILE"], "w") as f:
                f.write(str(pid))
        for signum in PASSED_ON:
            signal.signal(signum, lambda received, _: os.kill(pid, received))
        line = replies.readline()  # a signal passed on interrupts nothing here (PEP 475)
        status = int(line) if line.strip() else 1  # no status: the server went away
    if status < 0:  # ended by a signal: this process ends the same way
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
