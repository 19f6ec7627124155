"""The one `error` line a rank prints for a fault the user can fix, also kept for the launcher.

Every rank that stops on such a fault prints one line starting with `error`. Under the
project's launcher (scripts/launch.sh -> cluster/torchrun_job.py) the line is also appended to
the file named by PARM_ERROR_FILE, so that the launcher can repeat it as the job's last line,
below torchrun's own report of the failed ranks."""

from __future__ import annotations

import os
import sys

ERROR_FILE_ENV = "PARM_ERROR_FILE"


def say(line: str) -> None:
    """Print `line` (it starts with "error") to stderr and keep it for the launcher."""
    print(line, file=sys.stderr, flush=True)
    keep(line)


def keep(line: str) -> None:
    """Append `line` to PARM_ERROR_FILE, where the launcher set one (never fails)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "a") as out:
                out.write(line.replace("\n", " ") + "\n")
        except OSError:
            pass
