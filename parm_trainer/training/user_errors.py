"""Bad input ends a job with one line: the handler the entry points run under (user_errors),
and the checks they run first, before they import torch and megatron-core (check_flags_first).

check_flags_first parses the flags, checks the layout against the world size and the files the
run reads (data/input_files.py): what initialize() checks first, without reading the data set's
index through megatron-core or asking torch about CUDA. A rank that imports torch and
megatron-core spends about 4.5 s of CPU more than one that does not (0.3 s: 4 ranks of a
2-core node end about 8 s sooner), so bad flags and mistyped paths end a job at once.
initialize() runs the same checks again with the rest. With --use-checkpoint-args the model's
flags come from the checkpoint first, so there the checks wait for initialize().
This module and what check_flags_first imports import no torch (tests/test_flags_first.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from parm_trainer import error_line
from parm_trainer.errors import USER_ERRORS
from parm_trainer.training import watchdog


def rank() -> int:
    torch = sys.modules.get("torch")  # not imported yet: no process group either
    if torch is not None and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def user_errors(*extra_types):
    """Turn errors in the user's input into one line on rank 0 and exit status 1 on all ranks.

    The listed types are raised identically on every rank (checks without communication, or
    after a collective that shared the verdict), so one line from rank 0 tells the whole story.
    A collective that fails because a peer stopped or died ends the job as the watchdog does,
    with its line naming the silent rank. Anything else keeps its traceback.
    """
    known = (*USER_ERRORS, *extra_types)
    try:
        yield
    except known as error:
        # Rank 0 speaks at once. Other ranks wait a moment first: torchrun stops the whole job
        # when rank 0 exits, so usually a single line appears; if rank 0 is slow to reach the
        # same error, the first rank to finish waiting says it instead.
        me = rank()
        if me != 0:
            time.sleep(3.0)
        prefix = "error" if me == 0 else f"error (rank {me})"
        error_line.say(f"{prefix}: {error}")
        sys.stdout.flush()
        watchdog.stop_helpers()
        os._exit(1)  # no teardown: other ranks may already be gone
    except RuntimeError as error:  # a collective whose peer stopped or died: the watchdog's line
        if not watchdog.is_collective_failure(error):
            raise
        watchdog.end_on_collective_failure(error)  # its helpers stopped first


def check_flags_first(argv: list, extra_args_provider=None) -> None:
    """The flags parsed, the layout and the input files checked, before torch is imported (an
    entry point's first step; argparse's own errors end the process here too)."""
    if "--use-checkpoint-args" in argv:
        return
    from parm_trainer.arguments import parse_args
    from parm_trainer.data.input_files import check_inputs
    from parm_trainer.planning.checks import validate_layout
    from parm_trainer.schedule.auto import resolve_auto_schedule

    with user_errors():
        args = parse_args(argv, extra_args_provider, without_torch=True)
        resolve_auto_schedule(args, log=lambda line: None)
        validate_layout(args)
        check_inputs(args)
