"""parm_trainer/compat/cpu.py's patches that activation recomputation needs, patched: megatron-
core's checkpointing replays dropout from the saved RNG states without CUDA, and its
output-discarding checkpoint runs without Transformer Engine. Whether each patch is still
needed, and the rest of the patches: tests/test_compat_cpu.py.
"""

import pytest
import torch

from parm_trainer.compat import cpu

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="cpu.apply() leaves megatron-core untouched where CUDA runs"
)


@pytest.fixture(scope="module")
def mrandom():
    cpu.apply()
    from megatron.core.tensor_parallel import random

    return random


def test_rng_checkpoint_replays_dropout(mrandom):
    """Activation recomputation (tensor_parallel.checkpoint) replays the dropout of the default
    stream and of the tracker's streams: the gradients of the run without recomputation."""
    def layer(x):
        with mrandom.get_cuda_rng_tracker().fork():
            x = torch.nn.functional.dropout(x * 3, 0.5)
        return torch.nn.functional.dropout(x.sin(), 0.3)

    grads = []
    for recompute in (False, True):
        torch.manual_seed(11)
        mrandom.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0,
                                                force_reset_rng=True)
        x = torch.randn(64, requires_grad=True)
        y = mrandom.checkpoint(layer, False, x) if recompute else layer(x)
        (y * torch.arange(64.0)).sum().backward()
        grads.append((y.detach(), x.grad, torch.rand(3)))  # and the streams after it
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert (grads[1][1] == 0).sum() > 10  # dropout was applied


def test_checkpoint_without_output_patched(mrandom):
    """The output is discarded after the forward and recomputed, with the RNG replayed, before
    the backward that needs it: the gradients of the plain computation."""
    grads = []
    for discard in (False, True):
        torch.manual_seed(3)
        x = torch.randn(32, requires_grad=True)
        keeper = mrandom.CheckpointWithoutOutput()
        assert keeper.fp8 is False
        inner = (keeper.checkpoint(lambda t: torch.nn.functional.dropout(t.sin(), 0.5), x)
                 if discard else torch.nn.functional.dropout(x.sin(), 0.5))
        out = inner * inner  # saves the inner output for its backward
        if discard:
            keeper.discard_output_and_register_recompute(out)
            assert inner.untyped_storage().nbytes() == 0
        out.sum().backward()
        grads.append(x.grad)
    assert torch.equal(*grads) and (grads[0] == 0).sum() > 4
