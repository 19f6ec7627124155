"""--memory-probe: this rank's memory measured from its tensors, to check the start-up estimate.

    probe = SavedActivations(model)          # around the first iteration's forward-backward
    with probe: run_schedule(...)
    line = report(args, model, optimizer, probe.peak_bytes)   # collective, after the step

Activations: every tensor autograd saves for a backward (saved_tensors_hooks), counted once
per storage, excluding parameters, and held until autograd lets go of it; the peak over the
iteration is what the micro-batches in flight kept at once (1F1B runs P - k forwards ahead on
stage k). State: the bytes of the parameters, of megatron DDP's gradient buffers and of every
optimizer state tensor (Adam's moments, fp32 copies), each storage once.
"""

from __future__ import annotations

import weakref

import torch

from parm_trainer.parallel import rank_device
from parm_trainer.planning.memory_estimate import MIB


class _Held:
    """What the pack hook returns: the saved tensor, and on release the count goes down."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedActivations:
    """Context manager: the peak bytes of saved activations alive at once."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for chunk in model
                       for p in chunk.parameters()}
        self.alive, self.bytes, self.peak_bytes = {}, 0, 0
        self._hooks = None

    def _release(self, key, nbytes):
        self.alive[key] -= 1
        if not self.alive[key]:
            del self.alive[key]
            self.bytes -= nbytes

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.params or storage.nbytes() == 0:
            return tensor
        if key not in self.alive:
            self.alive[key] = 0
            self.bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.alive[key] += 1
        held = _Held(tensor)
        weakref.finalize(held, self._release, key, storage.nbytes())
        return held

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def hooks(self):
        """The saved-tensor hooks as a context of their own, for another thread (hooks are
        per thread): microbatch_overlap's micro-batches enter it on theirs."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks = self.hooks()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _storages(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_bytes(model, optimizer) -> tuple:
    """(parameters and gradient buffers, optimizer state) bytes on this rank."""
    params = [p for chunk in model for p in chunk.parameters()]
    grads = [getattr(p, "main_grad", None) for p in params]
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    states = []
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", opt)
        states += [v for state in torch_opt.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0]
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            states += list(group)
    return _storages(params) + _storages(grads), _storages(states)


def report(args, model, optimizer, activation_peak: int) -> list:
    """Log lines: measured against estimated, per pipeline rank, each the max over the ranks
    of that stage (every rank calls this: one all-reduce)."""
    from megatron.core import parallel_state

    weights, optim = state_bytes(model, optimizer)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    table = torch.zeros(pp, 3, dtype=torch.float64, device=rank_device())
    table[rank] = torch.tensor([weights, optim, activation_peak], dtype=torch.float64)
    torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX)
    table = table.cpu()
    estimate = getattr(args, "memory_estimate", None)
    lines = ["memory probe (measured at the first iteration, max over each stage's ranks):"]
    for r in range(pp):
        w, o, a = (table[r] / MIB).tolist()
        line = (f"  PP rank {r}: weights and gradients {w:.2f} MiB, optimizer {o:.2f} MiB, "
                f"activations {a:.2f} MiB")
        if estimate:
            e = estimate[r]
            line += (f" (estimate {e['weights_grads'] / MIB:.2f}, {e['optimizer'] / MIB:.2f}, "
                     f"{e['activations'] / MIB:.2f})")
        lines.append(line)
    return lines
