"""Re-run a tool as N local ranks under torchrun: what the tools' --nproc flag does."""

from __future__ import annotations

import os
import subprocess
import sys


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
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), os.path.abspath(script), *_without_nproc(argv)]
    return subprocess.call(command, env=env)
