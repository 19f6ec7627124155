"""Start-up time of the entry points, paid by every rank at every start. Called by the entry
scripts (and the tools torchrun launches) before megatron-core is imported; a library import
must not change what its user's process sees.

skip_wandb_unless_asked: megatron-core imports wandb whether or not a run logs to it
(megatron/core/inference/contexts/dynamic_context.py, `try: import wandb`), 0.6 s of CPU per
process, 2.4 s per node of 4 ranks. An entry point not asked to log to wandb marks it absent,
and megatron-core takes its no-wandb path.

eager_fusions_without_cuda: megatron-core wraps its fused element-wise kernels (bias-GELU,
SwiGLU, ...) in torch.compile when it is imported (megatron/core/jit.py, jit_fuser), which
imports torch._dynamo and torch._inductor: about 3 s of CPU per process, on a machine without
CUDA where those kernels run eagerly anyway (this project's CPU runs do not fuse them). Without
CUDA, megatron-core is imported with torch.compile standing aside (the functions stay the plain
Python functions, the same arithmetic); with CUDA nothing changes.
"""

from __future__ import annotations

import contextlib
import sys


def asks_for_wandb(argv: list) -> bool:
    return any(a.startswith("--wandb-project") for a in argv)


def skip_wandb_unless_asked(argv: list) -> None:
    if "wandb" not in sys.modules and not asks_for_wandb(argv):
        sys.modules["wandb"] = None  # `import wandb` now raises ImportError


def _eager(model=None, **_options):
    """torch.compile's two call forms, compiling nothing."""
    return model if model is not None else (lambda function: function)


@contextlib.contextmanager
def compile_stands_aside():
    """Without CUDA, torch.compile compiles nothing inside the block: megatron-core imported in
    it binds its jit_fuser to the plain functions (the entry points' flag checks run in it, in
    case a check imports megatron-core)."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    compile_ = torch.compile
    torch.compile = _eager
    try:
        yield
    finally:
        torch.compile = compile_


def eager_fusions_without_cuda() -> None:
    if "megatron.core" in sys.modules:
        return
    with compile_stands_aside():
        import megatron.core.jit  # noqa: F401 (megatron-core's decorators run now)
