"""torchrun for the project's launcher (scripts/launch.sh): a failed job's error line last.

torchrun ends a failed job with its own report, a traceback of its agent and a block per failed
rank (about 60 lines), below the ranks' output, so the line that says what went wrong is buried
above it. Here torchrun runs in this process with its agent's log and that report written to a
log file; the ranks print as they always do but for their `error` lines, which error_line.py
writes to PARM_ERROR_FILE (set here), and a failed job ends with its error line, printed once
after every rank has ended: the first one of this node's ranks wrote or, where none did, a
line naming the rank that failed first and how. A master port already in use is one line
naming MASTER_PORT. A restart (MAX_RESTARTS) is still said on the terminal.

A rank stopped from outside (SIGSTOP, a debugger) answers no signal but SIGKILL, and torchrun
would wait for it forever where the ranks that noticed (their watchdog names it) are on
another node: a rank of this node stopped for longer than the watchdog's limit plus
REAP_MARGIN_S is ended with SIGKILL here, and the job ends on every node.

Where the training script is given --exit-signal-handler, its --exit-signal reaching this
process (slurm signals every process of a job step) is passed on to the ranks and nothing
else: torchrun would instead stop them and give them 30 s before SIGKILL, and the job would
exit non-zero; here the ranks save at the iteration boundary and the job exits 0.

    python -m parm_trainer.cluster.torchrun_job TORCHRUN_ARGS...   (what launch.sh runs)
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time

from parm_trainer.error_line import ERROR_FILE_ENV
from parm_trainer.process_exit import end

# torchrun's agent logs under these names (torch.distributed.elastic.utils.logging)
AGENT_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic",
                 "torch.distributed.launcher")
SAID_ON_THE_TERMINAL = ("will restart worker group",)
REAP_MARGIN_S = 5.0


def _log_path() -> str:
    return os.environ.get("PARM_LAUNCH_LOG") or os.path.join(
        tempfile.gettempdir(), f"parm_trainer_torchrun_{socket.gethostname()}_{os.getpid()}.log")


class _Restarts(logging.Handler):
    """torchrun restarting the ranks (MAX_RESTARTS): the error line that ended the attempt,
    then torchrun's own line, on the terminal."""

    def __init__(self, errors_path: str):
        super().__init__()
        self.errors_path = errors_path

    def emit(self, record) -> None:
        if not any(words in record.getMessage() for words in SAID_ON_THE_TERMINAL):
            return
        line = _kept_line(self.errors_path)
        if line is not None:
            print(line, file=sys.stderr)
            open(self.errors_path, "w").close()
        print(f"torchrun: {record.getMessage()}", file=sys.stderr, flush=True)


def _route_agent_log(path: str, errors_path: str) -> logging.Handler:
    """The agent's log to `path`; of it, restarts also to stderr."""
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in AGENT_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [to_file, _Restarts(errors_path)]
        logger.propagate = False
    return to_file


def _kept_line(path: str) -> str | None:
    try:
        with open(path) as lines:
            return next((line.rstrip("\n") for line in lines if line.strip()), None)
    except OSError:
        return None


def _failure_line(failure) -> str:
    """torchrun's first observed failure as one line."""
    rank, first = failure.get_first_failure()
    how = (f"was ended by {first.signal_name()}" if first.exitcode < 0
           else f"exited with status {first.exitcode}")
    return (f"error: rank {rank} (local rank {first.local_rank} on {socket.gethostname()}) {how}"
            " (its output above)")


def _script_flags(script_args: list):
    """The training script's flags this launcher acts on, read as its parser reads them (a
    bad value falls back to the defaults: the ranks refuse it themselves)."""
    import argparse

    class Quiet(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    parser = Quiet(add_help=False, allow_abbrev=False)
    parser.add_argument("--exit-signal-handler", action="store_true")
    parser.add_argument("--exit-signal", default="SIGTERM")
    parser.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    parser.add_argument("--watchdog-timeout-minutes", type=float, default=None)
    try:
        return parser.parse_known_args(script_args)[0]
    except ValueError:
        return parser.parse_args([])


def _exit_signal(flags):
    """The signal the ranks save and exit on (--exit-signal-handler), or None."""
    return getattr(signal.Signals, flags.exit_signal, None) if flags.exit_signal_handler \
        else None


def _pass_on(signum, frame) -> None:
    import psutil

    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


def _stopped_rank_limit_s(flags) -> float:
    """How long a rank may stay stopped: the watchdog's limit (the collectives' timeout where
    the watchdog is off), plus REAP_MARGIN_S."""
    from parm_trainer.training.watchdog import limit_s

    if flags.watchdog_timeout_minutes is None:  # parse_args's default
        flags.watchdog_timeout_minutes = flags.distributed_timeout_minutes
    seconds = limit_s(flags) if flags.watchdog_timeout_minutes else \
        flags.distributed_timeout_minutes * 60.0
    return seconds + REAP_MARGIN_S


class _StoppedRanks(threading.Thread):
    """SIGKILL for a child of this process stopped for longer than limit_s."""

    def __init__(self, limit_s: float):
        super().__init__(name="parm-stopped-ranks", daemon=True)
        self.limit_s, self.ended, self.done = limit_s, [], threading.Event()

    def run(self) -> None:
        import psutil

        me, since = psutil.Process(), {}
        while not self.done.wait(1.0):
            now = time.monotonic()
            for child in me.children():
                try:
                    if child.status() != psutil.STATUS_STOPPED:
                        since.pop(child.pid, None)
                    elif now - since.setdefault(child.pid, now) > self.limit_s:
                        child.kill()
                        self.ended.append(child.pid)
                except psutil.Error:
                    pass


def _remove(*paths) -> None:
    for path in paths:
        if path != os.environ.get("PARM_LAUNCH_LOG") and os.path.exists(path):
            os.remove(path)


def main(argv=None) -> int:
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    flags = _script_flags(args.training_script_args)
    exit_signal = _exit_signal(flags)
    if exit_signal is not None:  # the ranks', not torchrun's
        args.signals_to_handle = ",".join(
            name for name in args.signals_to_handle.split(",") if name != exit_signal.name)
        signal.signal(exit_signal, _pass_on)
    log_path = _log_path()
    errors_path = log_path + ".errors"
    if os.path.exists(errors_path):
        os.remove(errors_path)
    os.environ[ERROR_FILE_ENV] = errors_path  # the ranks inherit it
    handler = _route_agent_log(log_path, errors_path)
    stopped = _StoppedRanks(_stopped_rank_limit_s(flags))
    stopped.start()
    try:
        run(args)
        _remove(errors_path, log_path)
        return 0
    except SignalException as signalled:  # the ranks had it too (torchrun passes it on)
        _remove(errors_path)
        return 128 + signalled.sigval
    except ChildFailedError as failure:
        handler.stream.write(failure.format_msg() + "\n")
        handler.flush()
        line = _kept_line(errors_path)
        if line is None and stopped.ended:  # the line is the watchdog's, on another node
            line = (f"{socket.gethostname()}: this node's ranks stopped for over "
                    f"{stopped.limit_s:.0f} s (pids {', '.join(map(str, stopped.ended))}) "
                    f"were ended with SIGKILL; the watchdog's error line names them")
        line = line or _failure_line(failure)
        print(f"(torchrun's report: {log_path})", file=sys.stderr)
    except DistNetworkError as error:
        if "EADDRINUSE" not in str(error):
            raise
        line = (f"error: MASTER_PORT {args.master_port} is in use on {args.master_addr} "
                f"(another job, or one not yet ended); set MASTER_PORT to a free port")
    finally:
        stopped.done.set()
    print(line, file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    end(main())
