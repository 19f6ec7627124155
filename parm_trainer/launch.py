"""Re-run a tool as N local ranks under torchrun: what the tools' --nproc flag does; and the
command every tool starts torchrun with.

PARM_TORCHRUN, where set, is that command, split as a shell splits it (a site's own wrapper of
torchrun; the tests' launcher, whose ranks fork from a process that imported torch once);
otherwise this Python's `-m torch.distributed.run`. A command that is not there is refused
in one line.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

TORCHRUN_ENV = "PARM_TORCHRUN"


def torchrun_command() -> list:
    given = shlex.split(os.environ.get(TORCHRUN_ENV, ""))
    if not given:
        return [sys.executable, "-m", "torch.distributed.run"]
    if shutil.which(given[0]) is None:
        sys.exit(f"error: {TORCHRUN_ENV}={os.environ[TORCHRUN_ENV]!r}: no command {given[0]!r} "
                 "(unset it to run this Python's -m torch.distributed.run)")
    return given


def _without_nproc(argv):
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--nproc":
            skip = True
        elif not item.startswith("--nproc="):
            out.append(item)
    return out


def relaunch(script: str, argv, nproc: int) -> int:
    """Run `script` with argv (less --nproc) as `nproc` ranks on this machine; exit status."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [*torchrun_command(), "--standalone", "--nproc-per-node", str(nproc),
               os.path.abspath(script), *_without_nproc(argv)]
    return subprocess.call(command, env=env)
