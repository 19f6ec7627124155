"""Run megatron-core 0.16 on a machine without CUDA (CPU tensors, gloo collectives).

    from parm_trainer.compat import cpu; cpu.apply()   # before building any megatron module

megatron-core assumes CUDA in a handful of places. Each patch below names the megatron-core
place it answers. `apply()` does nothing when CUDA is available, so GPU clusters run megatron-core
untouched. tests/test_compat_cpu.py checks every patch: that megatron-core still fails without
it (so a patch that is no longer needed is noticed) and that the patched behaviour is right.
"""

from __future__ import annotations

import contextlib

import torch

_APPLIED: list[str] = []


def cuda_missing() -> bool:
    return not torch.cuda.is_available()


# --- 1. CUDA RNG tracker ------------------------------------------------------------------
# megatron/core/tensor_parallel/random.py: CudaRNGStatesTracker.add/fork read and write
# torch.cuda.get_rng_state(), which raises "Torch not compiled with CUDA enabled". The tracker
# keeps separate streams for tensor-parallel and expert-parallel initialisation and dropout;
# on CPU the same bookkeeping works on the CPU generator. Activation recomputation
# (tensor_parallel.checkpoint, CheckpointWithoutOutput: _get_all_rng_states/_set_all_rng_states)
# saves the CPU generator, the CUDA one (_get_cuda_rng_state: the same error) and the tracker's
# streams, and restores them to replay dropout; without CUDA there is no CUDA generator, so its
# slot holds None and is left alone (the CPU generator and the tracker's streams replay it).


def _cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """megatron's tracker with the CPU generator standing in for the CUDA one."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            original = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    CpuRNGStatesTracker._parm_cpu = True
    return CpuRNGStatesTracker


def patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom.CudaRNGStatesTracker, "_parm_cpu", False):
        return
    mrandom.CudaRNGStatesTracker = _cpu_tracker_class()
    mrandom.initialize_rng_tracker(force_reset=True)
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


# --- 2. torch norm under sequence parallelism ----------------------------------------------
# megatron/core/transformer/torch_norm.py: WrappedTorchNorm asserts `not config.sequence_parallel`
# (the fused Apex/TE norms are the only ones megatron allows there). The norm itself needs no
# change under sequence parallelism; what matters is that its replicated weight and bias carry
# `sequence_parallel = True`, so finalize_model_grads all-reduces their gradients over the
# tensor-parallel group exactly as it does for the fused norms.


def patch_torch_norm_sequence_parallel() -> None:
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__new__
    if getattr(original_new, "_parm_cpu", False):
        return

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        plain = copy.copy(config)  # copy.copy skips __post_init__'s validation
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new._parm_cpu = True
    WrappedTorchNorm.__new__ = staticmethod(new)


# --- 3. CUDA device, streams and events ---------------------------------------------------
# megatron-core calls torch.cuda.current_device() as the `device=` of new tensors (175 sites:
# tensor_parallel/layers.py, transformer/moe/*, distributed/param_and_grad_buffer.py, ...),
# creates side streams and events for overlap (MoEAlltoAllTokenDispatcher.__init__ in
# transformer/moe/token_dispatcher.py: `torch.cuda.Stream()`; distributed/ and optimizer/
# record events) and calls torch.cuda.synchronize() around timers. On CPU every op is
# synchronous on the calling thread, so a stream or event has nothing to order: null objects
# keep the calls valid, and the current device is the CPU.


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _NullStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


_NULL_STREAM = _NullStream()


def patch_cuda_device_streams_events() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda device=None: _NULL_STREAM
    cuda.default_stream = lambda device=None: _NULL_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None


# --- 4. 'cuda' literals in tensor factories ---------------------------------------------
# These megatron-core modules create tensors with device="cuda" / device='cuda' (or call
# .cuda()) on paths every run takes, e.g. optimizer/optimizer.py FP32Optimizer.__init__
# (`self._scale = torch.tensor([1.0], ..., device='cuda')`), optimizer/clip_grads.py
# get_grad_norm_fp32, pipeline_parallel/schedules.py (`total_num_tokens = torch.zeros(...,
# device="cuda")`), transformer/utils.py get_default_causal_mask. Each listed module gets its own
# `torch` name bound to a proxy whose factory functions map a CUDA device to the CPU; the rest
# of torch, and every other module, is untouched.
CUDA_LITERAL_MODULES = (
    "megatron.core.transformer.utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.tensor_parallel.data",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
)
_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
              "zeros_like", "ones_like", "empty_like", "full_like")


def _is_cuda(device) -> bool:
    return device is not None and str(device).startswith("cuda")


def _on_cpu(factory):
    def make(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return make


class _CpuTorch:
    """`torch` as seen by one megatron module: CUDA factory devices become the CPU."""

    _parm_cpu = True

    def __init__(self):
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def _tensor_cuda_is_identity(self, device=None, non_blocking=False, **kwargs):
    return self


def patch_cuda_literals() -> None:
    import importlib

    proxy = _CpuTorch()
    for name in CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = proxy
    # `.cuda()` on a tensor (exchange_utils, distrib_optimizer, optimizer state loading)
    torch.Tensor.cuda = _tensor_cuda_is_identity


# --- 5. a name missing from moe_utils without Transformer Engine -------------------------
# megatron/core/transformer/moe/moe_utils.py imports te_general_gemm inside `try: ... except
# ImportError: HAVE_TE = False` and never defines it in the except branch, yet
# RouterGatingLinearFunction.forward tests `if te_general_gemm is not None`: NameError on every
# router forward without Transformer Engine. This happens on a GPU without TE too, so this patch
# is applied whenever the name is missing, not only without CUDA.


def te_general_gemm_missing() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def patch_moe_utils_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


# --- 5b. output-discarding recomputation without Transformer Engine --------------------------
# megatron/core/tensor_parallel/random.py: CheckpointWithoutOutput.__init__(fp8=False) sets
# `self.fp8 = fp8 is not None`, True for its default, and CheckpointWithoutOutputFunction.forward
# then calls FP8GlobalStateManager, which only Transformer Engine defines: NameError wherever
# TransformerLayer (--recompute-modules layernorm) or GroupedMLP (moe_act) uses it without TE,
# on a GPU too. FP8 needs Transformer Engine, so without it the flag is False.


def checkpoint_fp8_name_missing() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return not mrandom.HAVE_TE and not hasattr(mrandom, "FP8GlobalStateManager")


def patch_checkpoint_without_output_fp8() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    init = mrandom.CheckpointWithoutOutput.__init__

    def __init__(self, fp8=False):
        init(self, fp8)
        self.fp8 = False  # no Transformer Engine, no FP8

    mrandom.CheckpointWithoutOutput.__init__ = __init__


# --- 6. split sizes for gloo's all_to_all_single -------------------------------------------
# megatron/core/transformer/moe/moe_utils.py: maybe_move_tensor_to_cpu(t, as_numpy=True) only
# converts when `t.is_cuda`; MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize relies on it
# to turn input_splits/output_splits into numpy for all_to_all_single. On CPU the tensors are
# returned unchanged and all_to_all_single rejects tensor split sizes (TypeError).


def _move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def patch_split_sizes_to_numpy() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for module in (moe_utils, token_dispatcher):
        module.maybe_move_tensor_to_cpu = _move_tensor_to_cpu


# --- 7. uneven AllGather on gloo -------------------------------------------------------------
# megatron/core/tensor_parallel/mappings.py: _gather_along_first_dim(output_split_sizes=...)
# calls torch.distributed.all_gather with pieces of different sizes per rank; the MoE
# dispatchers use it under sequence parallelism (gather_from_sequence_parallel_region with
# uneven token counts). Gloo requires equal sizes ("ProcessGroupGloo::allgather: invalid tensor
# size"). The fallback pads every piece to the largest, gathers, and trims: same result, a few
# more bytes. (The uneven reduce_scatter beside it works on gloo and is left alone.)


def _uneven_all_gather(input_, group, sizes):
    world = torch.distributed.get_world_size(group)
    if world == 1:
        return input_
    largest = max(sizes)
    padded = input_.new_zeros((largest,) + tuple(input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    pieces = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)], dim=0)


def patch_uneven_all_gather() -> None:
    from megatron.core.tensor_parallel import mappings

    gather = mappings._gather_along_first_dim
    if getattr(gather, "_parm_cpu", False):
        return

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None:
            return gather(input_, group, None, use_global_buffer)
        return _uneven_all_gather(input_, group, list(output_split_sizes))

    gather_along_first_dim._parm_cpu = True
    mappings._gather_along_first_dim = gather_along_first_dim


# --- 8. type-string asserts ------------------------------------------------------------------
# megatron-core tells fp32 from fp16/bf16 parameters by comparing `tensor.type()` with CUDA type
# names: optimizer/clip_grads.py clip_grad_by_total_norm_fp32 (`assert param.grad.type() ==
# 'torch.cuda.FloatTensor'`), optimizer/optimizer.py Float16OptimizerWithFloat16Params.__init__
# and optimizer/distrib_optimizer.py _build_model_and_main_param_groups (`elif
# model_param.type() == 'torch.cuda.FloatTensor'`, else TypeError). Called with no argument from
# one of these modules, Tensor.type() answers with the CUDA name of the same dtype; everywhere
# else it is unchanged.
TYPE_STRING_MODULES = (
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
)


def patch_type_strings() -> None:
    import sys

    original = torch.Tensor.type
    if getattr(original, "_parm_cpu", False):
        return

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller in TYPE_STRING_MODULES and not name.startswith("torch.cuda."):
                return name.replace("torch.", "torch.cuda.", 1)
            return name
        return original(self, dtype, non_blocking, **kwargs)

    type_._parm_cpu = True
    torch.Tensor.type = type_

# --- 9. grouped GEMM on CPU --------------------------------------------------------------------
# megatron/core/transformer/moe/experts.py: GroupedMLP (--moe-grouped-gemm without Transformer
# Engine) asserts grouped_gemm_util.grouped_gemm_is_available() and calls
# grouped_gemm_util.ops.gmm, from the `grouped_gemm` package: CUDA kernels only. On CPU the
# same product is one matmul per expert on its rows; the layer, its weight layout and its
# checkpoint format are megatron's own, so --moe-grouped-gemm runs (and is tested) here.


def grouped_gemm_missing() -> bool:
    from megatron.core.transformer.moe import grouped_gemm_util

    return cuda_missing() and not grouped_gemm_util.grouped_gemm_is_available()


def grouped_matmul(a, b, batch_sizes, trans_b=False):
    """grouped_gemm.ops.gmm: rows of a in len(batch_sizes) runs, run i times b[i] (b[i].T with
    trans_b); autograd through torch's own matmuls."""
    runs = torch.split(a, [int(n) for n in batch_sizes.tolist()], dim=0)
    return torch.cat([run @ (w.t() if trans_b else w) for run, w in zip(runs, b)], dim=0)


def patch_grouped_gemm() -> None:
    import types

    from megatron.core.transformer.moe import grouped_gemm_util

    ops = types.SimpleNamespace(gmm=grouped_matmul)
    grouped_gemm_util.grouped_gemm = types.SimpleNamespace(ops=ops, parm_cpu=True)
    grouped_gemm_util.ops = ops


PATCHES = [
    (patch_type_strings, cuda_missing),
    (patch_rng_tracker, cuda_missing),
    (patch_uneven_all_gather, cuda_missing),
    (patch_split_sizes_to_numpy, cuda_missing),
    (patch_torch_norm_sequence_parallel, cuda_missing),
    (patch_cuda_device_streams_events, cuda_missing),
    (patch_cuda_literals, cuda_missing),
    (patch_moe_utils_te_general_gemm, te_general_gemm_missing),
    (patch_checkpoint_without_output_fp8, checkpoint_fp8_name_missing),
    (patch_grouped_gemm, grouped_gemm_missing),
]


def apply() -> list[str]:
    """Apply each patch whose condition holds (once); returns the names applied so far."""
    for patch, needed in PATCHES:
        if patch.__name__ not in _APPLIED and needed():
            patch()
            _APPLIED.append(patch.__name__)
    return list(_APPLIED)
