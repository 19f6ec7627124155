"""The one `error` line a rank prints for a fault the user can fix.

Every rank that stops on such a fault says one line starting with `error`. Under the project's
launcher (scripts/launch.sh -> cluster/torchrun_job.py, which sets PARM_ERROR_FILE) the line is
written to that file instead of the terminal, and the launcher prints the first one once, as
the job's last line, after every rank has ended; elsewhere (plain torchrun, one process) the
rank prints it."""

from __future__ import annotations

import os
import sys

ERROR_FILE_ENV = "PARM_ERROR_FILE"


def say(line: str) -> None:
    """Say `line` (it starts with "error"): to the launcher, or to stderr."""
    if not keep(line):
        print(line, file=sys.stderr, flush=True)


def keep(line: str) -> bool:
    """Append `line` to PARM_ERROR_FILE; False where there is none or it cannot be written."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    try:
        with open(path, "a") as out:
            out.write(line.replace("\n", " ") + "\n")
        return True
    except OSError:
        return False
