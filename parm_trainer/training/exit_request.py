"""--exit-signal-handler, --exit-signal and --exit-duration-in-mins: stop saved, at an iteration.

Megatron-LM's meaning. With --exit-signal-handler a rank that receives --exit-signal (SIGTERM by
default: slurm's at a time limit or a preemption, or the one sbatch's --signal asks for ahead of
the limit) only notes it and trains on. After each iteration the ranks agree with one small
all-reduce (MAX of: a signal noted, this rank's minutes since the process started past
--exit-duration-in-mins); if any rank says so, every rank leaves the loop at that same
iteration, saves a checkpoint there and the job exits 0. The handler stays installed through
the save, so a second signal changes nothing, and a save is written whole or not at all
(checkpoint/save.py), so one cut short by SIGKILL leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import signal
import time

import torch

STARTED = time.time()  # the process's start, as near as the training package sees it


class ExitRequest:
    """One per training run; `due()` is collective (every rank calls it after each iteration)."""

    def __init__(self, args, device):
        self.minutes = args.exit_duration_in_mins
        self.signal = signal.Signals[args.exit_signal] if args.exit_signal_handler else None
        self.device = device
        self.noted = False
        if self.signal is not None:
            signal.signal(self.signal, self._note)

    @classmethod
    def of(cls, args, device) -> "ExitRequest | None":
        """None where neither flag is given: no collective per iteration."""
        wanted = args.exit_signal_handler or args.exit_duration_in_mins is not None
        return cls(args, device) if wanted else None

    def _note(self, signum, frame) -> None:
        self.noted = True

    def due(self) -> str | None:
        """Why every rank stops after this iteration, or None (the same on every rank)."""
        elapsed = (time.time() - STARTED) / 60.0
        late = self.minutes is not None and elapsed > self.minutes
        flags = torch.tensor([float(self.noted), float(late)], device=self.device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        noted, late = flags.tolist()
        if noted:
            return f"{self.signal.name} received (--exit-signal-handler)"
        if late:
            return f"past --exit-duration-in-mins {self.minutes:g}"
        return None

    def release(self) -> None:
        if self.signal is not None:
            signal.signal(self.signal, signal.SIG_DFL)
