"""Start-up time of the entry points: megatron-core imports wandb whether or not a run logs to
it (megatron/core/inference/contexts/dynamic_context.py, `try: import wandb`), 0.6 s of CPU per
process, 2.4 s per node of 4 ranks at every start. An entry point that is not asked to log to
wandb marks it absent before importing megatron-core, which then takes its no-wandb path.
Called by the entry scripts only: a library import must not hide a package from its user."""

from __future__ import annotations

import sys


def skip_wandb_unless_asked(argv: list) -> None:
    if "wandb" not in sys.modules and not any(a.startswith("--wandb-project") for a in argv):
        sys.modules["wandb"] = None  # `import wandb` now raises ImportError
