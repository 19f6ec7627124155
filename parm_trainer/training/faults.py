"""Fault injection for tests: PARM_FAULT names faults the training loop and the checkpoint code
cause on purpose (as megatron's FT_SIM_FAULT_DESC), so that tests can check what survives.

    PARM_FAULT=kill:rank=2:iter=7              rank 2 dies (SIGKILL) as iteration 7 starts
    PARM_FAULT=hang:rank=1:iter=5              rank 1 stops (SIGSTOP) as iteration 5 starts
    PARM_FAULT=kill-in-save:rank=0:phase=write rank 0 dies in a save: phase write (while the
                                               shards are written), rename (before the
                                               directory is renamed), renamed (after it, before
                                               the tracker), tracker (the tracker half-written)
    PARM_FAULT=nan:iter=6                      iteration 6's loss is NaN on every rank
    PARM_FAULT="kill:rank=2:iter=7;nan:iter=9" several, separated by ';'

rank defaults to every rank; kill-in-save without iter fires in the first save ("write": once
this rank's shards are written, the others' perhaps not; with --async-save just after this
rank's background writer started; the later phases when the save is finalised). A fault fires in the first attempt of
a job (TORCHELASTIC_RESTART_COUNT 0), so a restarted job runs clean, unless it names another
(attempt=N: in the N-th restart). configure() reads the variable at start-up (a malformed one
is an error there); unset, every hook is one comparison with None.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Optional
from parm_trainer.errors import FaultSpecError

KINDS = ("kill", "hang", "kill-in-save", "nan")
SAVE_PHASES = ("write", "rename", "renamed", "tracker")




@dataclass(frozen=True)
class Fault:
    kind: str
    rank: Optional[int] = None
    iteration: Optional[int] = None
    phase: Optional[str] = None
    attempt: int = 0

    def applies(self, rank: int, iteration: Optional[int]) -> bool:
        return ((self.rank is None or self.rank == rank)
                and (self.iteration is None or self.iteration == iteration))


def parse(text: str) -> list:
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, *fields = part.split(":")
        if kind not in KINDS:
            raise FaultSpecError(f"PARM_FAULT {part!r}: the kind must be one of {', '.join(KINDS)}")
        values = {}
        for field in fields:
            key, _, value = field.partition("=")
            if key not in ("rank", "iter", "phase", "attempt") or not value:
                raise FaultSpecError(f"PARM_FAULT {part!r}: {field!r} is not rank=N, iter=N, "
                                     f"phase=NAME or attempt=N")
            values[key] = value
        phase = values.get("phase")
        if kind == "kill-in-save" and phase not in SAVE_PHASES:
            raise FaultSpecError(f"PARM_FAULT {part!r}: phase must be one of "
                                 f"{', '.join(SAVE_PHASES)}")
        if kind in ("kill", "hang", "nan") and "iter" not in values:
            raise FaultSpecError(f"PARM_FAULT {part!r}: give iter=N")
        try:
            faults.append(Fault(kind, int(values["rank"]) if "rank" in values else None,
                                int(values["iter"]) if "iter" in values else None, phase,
                                int(values.get("attempt", 0))))
        except ValueError:
            raise FaultSpecError(f"PARM_FAULT {part!r}: rank, iter and attempt are "
                                 f"integers") from None
    return faults


_FAULTS: Optional[list] = None


def configure() -> None:
    global _FAULTS
    text = os.environ.get("PARM_FAULT")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faults = [fault for fault in parse(text) if fault.attempt == attempt] if text else []
    _FAULTS = faults or None


def _rank() -> int:
    import torch

    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _die(how: int, what: str) -> None:
    print(f"PARM_FAULT: rank {_rank()}: {what}", flush=True)
    os.kill(os.getpid(), how)


def at_iteration(iteration: int) -> None:
    """Called as each iteration starts: the kill and hang faults."""
    if _FAULTS is None:
        return
    for fault in _FAULTS:
        if fault.kind in ("kill", "hang") and fault.applies(_rank(), iteration):
            _die(signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP,
                 f"{fault.kind} at iteration {iteration}")


def nan_at(iteration: int) -> bool:
    """Whether iteration's loss is to be NaN."""
    return _FAULTS is not None and any(
        f.kind == "nan" and f.applies(_rank(), iteration) for f in _FAULTS)


def in_save(phase: str, iteration: int) -> None:
    """Called at each phase of a save (SAVE_PHASES): the kill-in-save faults."""
    if _FAULTS is None:
        return
    for fault in _FAULTS:
        if fault.kind == "kill-in-save" and fault.phase == phase and fault.applies(
                _rank(), iteration):
            _die(signal.SIGKILL, f"killed in the save of iteration {iteration} ({phase})")
