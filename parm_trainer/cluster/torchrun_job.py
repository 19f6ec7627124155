"""torchrun for the project's launcher (scripts/launch.sh): a failed job's error line last.

torchrun ends a failed job with its own report, a traceback of its agent and a block per failed
rank (about 60 lines), below the ranks' output, so the line that says what went wrong is buried
above it. Here torchrun runs in this process with its agent's log and that report written to a
log file; the ranks print as they always do, and a failed job ends with its error line: the
first `error` line one of this node's ranks printed (error_line.py keeps them in
PARM_ERROR_FILE, set here), or, where none did, a line naming the rank that failed first and
how. A master port already in use is one line naming MASTER_PORT. A restart (MAX_RESTARTS)
is still said on the terminal.

    python -m parm_trainer.cluster.torchrun_job TORCHRUN_ARGS...   (what launch.sh runs)
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile

from parm_trainer.error_line import ERROR_FILE_ENV

# torchrun's agent logs under these names (torch.distributed.elastic.utils.logging)
AGENT_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic",
                 "torch.distributed.launcher")
SAID_ON_THE_TERMINAL = ("will restart worker group",)


def _log_path() -> str:
    return os.environ.get("PARM_LAUNCH_LOG") or os.path.join(
        tempfile.gettempdir(), f"parm_trainer_torchrun_{socket.gethostname()}_{os.getpid()}.log")


def _route_agent_log(path: str) -> logging.Handler:
    """The agent's log to `path`; of it, restarts also to stderr."""
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.addFilter(lambda record: any(words in record.getMessage()
                                             for words in SAID_ON_THE_TERMINAL))
    for name in AGENT_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [to_file, to_terminal]
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
    log_path = _log_path()
    errors_path = log_path + ".errors"
    if os.path.exists(errors_path):
        os.remove(errors_path)
    os.environ[ERROR_FILE_ENV] = errors_path  # the ranks inherit it
    handler = _route_agent_log(log_path)
    try:
        run(args)
        _remove(errors_path, log_path)
        return 0
    except SignalException as stopped:  # the ranks had it too (torchrun passes it on)
        _remove(errors_path)
        return 128 + stopped.sigval
    except ChildFailedError as failure:
        handler.stream.write(failure.format_msg() + "\n")
        handler.flush()
        line = _kept_line(errors_path) or _failure_line(failure)
        print(f"(torchrun's report: {log_path})", file=sys.stderr)
    except DistNetworkError as error:
        if "EADDRINUSE" not in str(error):
            raise
        line = (f"error: MASTER_PORT {args.master_port} is in use on {args.master_addr} "
                f"(another job, or one not yet ended); set MASTER_PORT to a free port")
    print(line, file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
