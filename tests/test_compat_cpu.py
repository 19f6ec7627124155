"""python -m pytest tests/test_compat_cpu.py -q

Every patch in parm_trainer/compat/cpu.py is checked twice:

* still needed: megatron-core without the patch still fails on this machine. These checks run
  in a process that never applied the patches (tests/worker_compat_unpatched.py, one for all
  of them, `unpatched_failures`, forked from the tests' torchrun server) or, for the
  collectives, on two gloo ranks (tests/test_compat_cpu_collectives.py), so the test process
  stays patched.
* patched is right: after `cpu.apply()` the patched behaviour matches an independent reference.

A patch that megatron-core no longer needs makes its "still needed" test fail: drop the patch
(or the module from its list) together with the check.
"""

import importlib
import inspect
import json
import re
import types
import warnings

import numpy as np
import pytest
import torch

from conftest import python
from parm_trainer.compat import cpu

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core: optional GPU extensions missing
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.utils import get_default_causal_mask
    from megatron.core.utils import GlobalMemoryBuffer

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="cpu.apply() leaves megatron-core untouched where CUDA runs"
)

NO_CUDA = "Torch not compiled with CUDA enabled"

# The test(s) covering each patch; test_every_patch_is_covered keeps this in step with PATCHES.
COVERAGE = {
    "patch_type_strings": ("test_type_strings_still_needed", "test_type_strings_patched"),
    "patch_rng_tracker": ("test_rng_tracker_still_needed", "test_rng_tracker_patched",
                          "test_rng_checkpoint_replays_dropout"),
    "patch_uneven_all_gather": (
        "test_uneven_gather_still_needed",
        "test_uneven_reduce_scatter_works_unpatched",
        "test_uneven_gather_scatter_patched",
    ),
    "patch_split_sizes_to_numpy": (
        "test_split_sizes_to_numpy_still_needed",
        "test_split_sizes_to_numpy_patched",
        "test_split_sizes_all_to_all_on_two_ranks",
    ),
    "patch_torch_norm_sequence_parallel": (
        "test_torch_norm_sequence_parallel_still_needed",
        "test_torch_norm_sequence_parallel_patched",
    ),
    "patch_cuda_device_streams_events": (
        "test_cuda_device_streams_events_still_needed",
        "test_cuda_device_streams_events_patched",
    ),
    "patch_cuda_literals": (
        "test_cuda_literals_still_needed",
        "test_cuda_literals_module_still_has_literal",
        "test_cuda_literals_patched",
    ),
    "patch_checkpoint_without_output_fp8": (
        "test_checkpoint_without_output_still_needed",
        "test_checkpoint_without_output_patched",
    ),
    "patch_moe_utils_te_general_gemm": (
        "test_moe_utils_te_general_gemm_still_needed",
        "test_moe_utils_te_general_gemm_patched",
    ),
    "patch_grouped_gemm": ("test_grouped_gemm_still_needed", "test_grouped_gemm_patched"),
}




@pytest.fixture(scope="module")
def unpatched_failures():
    """The probe's result: {"errors": {check: error or None}, "applied_with_cuda": [...]}."""
    proc = python("tests/worker_compat_unpatched.py", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_fails(unpatched_failures, check, *fragments):
    error = unpatched_failures["errors"][check]
    assert error is not None, (
        f"megatron-core no longer fails at '{check}': the patch may be unnecessary"
    )
    for fragment in fragments:
        assert fragment in error, f"'{check}' fails differently now: {error}"


# --- the test process, patched ----------------------------------------------------------------


@pytest.fixture(scope="module")
def patched():
    return cpu.apply()


def call_from_module(module_name, fn, *args):
    """Call fn(*args) from a frame whose module is module_name."""
    namespace = {"__name__": module_name, "fn": fn}
    exec("def caller(*args):\n    return fn(*args)\n", namespace)
    return namespace["caller"](*args)


# --- patch_type_strings -----------------------------------------------------------------------


def test_type_strings_still_needed(unpatched_failures):
    """clip_grad_by_total_norm_fp32 asserts a CUDA type name for an fp32 CPU grad."""
    assert_fails(
        unpatched_failures, "clip_type_assert",
        "AssertionError", "param.grad.type() == 'torch.cuda.FloatTensor'",
    )


@pytest.mark.parametrize("module_name", cpu.TYPE_STRING_MODULES)
def test_type_strings_module_still_compares_cuda_names(module_name):
    """Each listed module still compares Tensor.type() with a 'torch.cuda.*' name."""
    source = inspect.getsource(importlib.import_module(module_name))
    assert re.search(r"\.type\(\)\s*(==|in)\s*\[?\s*'torch\.cuda\.", source), (
        f"{module_name} no longer compares .type() with a CUDA type name: "
        "drop it from TYPE_STRING_MODULES"
    )


def test_type_strings_patched(patched):
    """CUDA type names only when asked from a listed module; clipping then works on CPU."""
    fp32, bf16 = torch.ones(2), torch.ones(2, dtype=torch.bfloat16)
    assert fp32.type() == "torch.FloatTensor"
    assert fp32.type(torch.float64).dtype == torch.float64  # the conversion form is unchanged
    for module_name in cpu.TYPE_STRING_MODULES:
        assert call_from_module(module_name, torch.Tensor.type, fp32) == "torch.cuda.FloatTensor"
        assert call_from_module(module_name, torch.Tensor.type, bf16) == "torch.cuda.BFloat16Tensor"
    unlisted = "megatron.core.optimizer"
    assert call_from_module(unlisted, torch.Tensor.type, fp32) == "torch.FloatTensor"

    # clip_grad_by_total_norm_fp32 scales each grad by max_norm / (total_norm + 1e-6).
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    grads = [torch.randn_like(p) * 10 for p in params]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    total_norm = torch.norm(torch.stack([g.norm() for g in grads])).item()
    clip_grad_by_total_norm_fp32(params, 1.0, total_norm)
    for param, grad in zip(params, grads):
        torch.testing.assert_close(param.grad, grad * (1.0 / (total_norm + 1.0e-6)))


# --- patch_rng_tracker ------------------------------------------------------------------------


def test_rng_tracker_still_needed(unpatched_failures):
    """CudaRNGStatesTracker.add and model_parallel_cuda_manual_seed read the CUDA RNG state."""
    assert_fails(unpatched_failures, "rng_tracker_add", NO_CUDA, "torch.cuda.get_rng_state()")
    assert_fails(unpatched_failures, "rng_manual_seed", NO_CUDA, "torch.cuda.get_rng_state()")
    assert_fails(unpatched_failures, "rng_checkpoint", NO_CUDA,
                 "torch.cuda.random.get_rng_state(device=device)")


def test_rng_tracker_patched(patched):
    """Seeded streams are reproducible, continue across forks and leave the default stream alone."""
    seed = 1234
    mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = mrandom.get_cuda_rng_tracker()
    assert getattr(type(tracker), "_parm_cpu", False)
    names = {  # stream name: its seed, as model_parallel_cuda_manual_seed derives them
        mrandom.get_data_parallel_rng_tracker_name(): seed,
        mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME: seed + 2718,
        mrandom.get_expert_parallel_rng_tracker_name(): seed + 1024,
    }
    assert set(tracker.get_states()) == set(names)

    torch.manual_seed(7)
    default_reference = torch.rand(6)
    torch.manual_seed(7)
    outside = [torch.rand(3)]
    for name, stream_seed in names.items():
        reference = torch.Generator().manual_seed(stream_seed)
        with tracker.fork(name):
            first = torch.rand(4)
        with tracker.fork(name):
            second = torch.rand(4)
        assert torch.equal(first, torch.rand(4, generator=reference))
        assert torch.equal(second, torch.rand(4, generator=reference))
    outside.append(torch.rand(3))
    assert torch.equal(torch.cat(outside), default_reference)

    with pytest.raises(Exception, match="already exists"):
        tracker.add("another", seed)
    with pytest.raises(Exception, match="is not added"):
        with tracker.fork("missing"):
            pass


# --- patch_split_sizes_to_numpy (its all_to_all on two ranks: test_compat_cpu_collectives.py) ----


def test_split_sizes_to_numpy_still_needed(unpatched_failures):
    """The dispatcher's split sizes stay tensors on CPU and all_to_all_single rejects them."""
    assert_fails(unpatched_failures, "all_to_all_split_sizes", "TypeError", "all_to_all_single")


def test_split_sizes_to_numpy_patched(patched):
    """maybe_move_tensor_to_cpu gives numpy split sizes, and the dispatcher keeps them."""
    splits = torch.tensor([3, 0, 5])
    as_numpy = moe_utils.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert isinstance(as_numpy, np.ndarray) and as_numpy.tolist() == [3, 0, 5]
    assert moe_utils.maybe_move_tensor_to_cpu(splits) is splits
    assert moe_utils.maybe_move_tensor_to_cpu(None, as_numpy=True) is None

    state = types.SimpleNamespace(
        drop_and_pad=False, cuda_dtoh_point="p", cuda_sync_point="p",
        cuda_dtoh_stream=torch.cuda.Stream(), input_splits=torch.tensor([1, 2]),
        output_splits=torch.tensor([2, 1]), output_splits_tp=None, num_out_tokens=3,
        num_local_experts=1, config=types.SimpleNamespace(moe_permute_fusion=False),
    )
    tokens_per_expert = torch.tensor([3])
    out = MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize(state, "p", tokens_per_expert)
    assert out is tokens_per_expert
    assert isinstance(state.input_splits, np.ndarray) and state.input_splits.tolist() == [1, 2]
    assert isinstance(state.output_splits, np.ndarray) and state.output_splits.tolist() == [2, 1]


# --- patch_torch_norm_sequence_parallel -------------------------------------------------------


def sequence_parallel_config(normalization="LayerNorm"):
    return TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, normalization=normalization,
        tensor_model_parallel_size=2, sequence_parallel=True,
    )


def test_torch_norm_sequence_parallel_still_needed(unpatched_failures):
    """WrappedTorchNorm refuses a config with sequence_parallel=True."""
    assert_fails(
        unpatched_failures, "torch_norm_sequence_parallel",
        "AssertionError", "sequence parallel not supported by torch LayerNorm",
    )


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_torch_norm_sequence_parallel_patched(patched, normalization):
    """Under sequence parallelism: the torch norm, params marked sequence_parallel, same output."""
    config = sequence_parallel_config(normalization)
    norm = WrappedTorchNorm(config, 8, eps=1e-5)
    assert config.sequence_parallel  # the caller's config is left as it was
    expected_class = torch.nn.LayerNorm if normalization == "LayerNorm" else torch.nn.RMSNorm
    assert type(norm) is expected_class
    params = list(norm.parameters())
    assert params and all(getattr(p, "sequence_parallel", False) for p in params)

    with torch.no_grad():
        for param in params:
            param.uniform_(0.5, 1.5)
    x = torch.randn(5, 3, 8)
    if normalization == "LayerNorm":
        reference = torch.nn.functional.layer_norm(x, (8,), norm.weight, norm.bias, 1e-5)
    else:
        reference = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), reference)

    plain = WrappedTorchNorm(
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2), 8
    )
    assert not any(getattr(p, "sequence_parallel", False) for p in plain.parameters())


# --- patch_cuda_device_streams_events ---------------------------------------------------------


def test_cuda_device_streams_events_still_needed(unpatched_failures):
    """torch.cuda's device, streams, events and synchronize fail, and megatron calls them."""
    assert_fails(unpatched_failures, "current_device", NO_CUDA)
    assert_fails(unpatched_failures, "global_memory_buffer", NO_CUDA, "torch.cuda.current_device()")
    assert_fails(unpatched_failures, "stream", "torch.cuda.Stream requires CUDA support")
    assert_fails(unpatched_failures, "event", "dummy base class Event")
    assert_fails(unpatched_failures, "synchronize", NO_CUDA)
    assert_fails(unpatched_failures, "dtoh_and_synchronize", NO_CUDA, "current_stream")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import token_dispatcher
    assert "torch.cuda.Stream()" in inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher)


def test_cuda_device_streams_events_patched(patched):
    """The current device is the CPU; null streams and events accept megatron's calls."""
    assert torch.cuda.current_device() == torch.device("cpu")
    buffer = GlobalMemoryBuffer().get_tensor((2, 3), torch.float, "probe")
    assert buffer.shape == (2, 3) and buffer.device.type == "cpu"

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        value = torch.ones(2) * 2
    event = stream.record_event()
    event.synchronize()
    assert event.query() and stream.query()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    end.wait(torch.cuda.default_stream())
    assert start.elapsed_time(end) == 0.0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.equal(value, torch.tensor([2.0, 2.0]))


# --- patch_cuda_literals ----------------------------------------------------------------------

CUDA_LITERAL = re.compile(r"""device\s*=\s*['"]cuda['"]|\.cuda\(""")


def test_cuda_literals_still_needed(unpatched_failures):
    """megatron's device='cuda' factories and .cuda() fail on CPU."""
    assert_fails(unpatched_failures, "causal_mask", NO_CUDA, 'device="cuda"')
    assert_fails(unpatched_failures, "fp32_optimizer", NO_CUDA, "device='cuda'")
    assert_fails(unpatched_failures, "l2_norm", NO_CUDA, 'device="cuda"')
    assert_fails(unpatched_failures, "tensor_cuda", NO_CUDA)


@pytest.mark.parametrize("module_name", cpu.CUDA_LITERAL_MODULES)
def test_cuda_literals_module_still_has_literal(patched, module_name):
    """Each listed module still has a 'cuda' device literal or .cuda(), and sees the CPU proxy."""
    module = importlib.import_module(module_name)
    assert CUDA_LITERAL.search(inspect.getsource(module)), (
        f"{module_name} has no device='cuda' literal or .cuda() any more: "
        "drop it from CUDA_LITERAL_MODULES"
    )
    assert isinstance(module.torch, cpu._CpuTorch)
    assert module.torch.zeros(2, device="cuda").device.type == "cpu"
    pinned = module.torch.tensor([1.0], device=torch.device("cuda"), pin_memory=True)
    assert pinned.device.type == "cpu"
    assert module.torch.nn is torch.nn


def test_cuda_literals_patched(patched, one_rank_gloo):
    """Listed modules make CPU tensors; torch elsewhere is untouched; FP32Optimizer steps on CPU."""
    assert torch.equal(get_default_causal_mask(5), torch.triu(torch.ones(5, 5), diagonal=1).bool())
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")  # only the listed modules see the proxy
    t = torch.ones(2)
    assert t.cuda() is t

    # FP32Optimizer with gradient clipping against torch's clip_grad_norm_ and SGD by hand.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    grads = [torch.randn_like(p) * 10 for p in params]
    reference = [p.detach().clone().requires_grad_() for p in params]
    for param, ref, grad in zip(params, reference, grads):
        param.grad, ref.grad = grad.clone(), grad.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = FP32Optimizer(
            torch.optim.SGD(params, lr=0.1), OptimizerConfig(lr=0.1, clip_grad=1.0), None
        )
    optimizer.tp_group = optimizer.grad_stats_parallel_group = one_rank_gloo
    assert torch.equal(optimizer.get_loss_scale(), torch.tensor([1.0]))
    success, grad_norm, _ = optimizer.step()
    assert success
    assert grad_norm == pytest.approx(ref_norm.item(), rel=1e-5)
    for param, ref in zip(params, reference):
        torch.testing.assert_close(param.detach(), (ref - 0.1 * ref.grad).detach())


# --- patch_checkpoint_without_output_fp8 -----------------------------------------------------


def test_checkpoint_without_output_still_needed(unpatched_failures):
    """Without Transformer Engine, CheckpointWithoutOutput() takes itself for FP8."""
    assert_fails(unpatched_failures, "checkpoint_without_output", "NameError",
                 "FP8GlobalStateManager")


# --- patch_moe_utils_te_general_gemm ----------------------------------------------------------


def test_moe_utils_te_general_gemm_still_needed(unpatched_failures):
    """Without Transformer Engine, the router's gating linear hits an undefined name."""
    assert_fails(
        unpatched_failures, "te_general_gemm", "NameError", "te_general_gemm",
    )


def test_moe_utils_te_general_gemm_patched(patched):
    """te_general_gemm is None, so the router's gating linear is a plain matmul."""
    assert moe_utils.te_general_gemm is None
    assert not cpu.te_general_gemm_missing()
    inp = torch.randn(2, 3, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    out = moe_utils.RouterGatingLinearFunction.apply(inp, weight, None, torch.float32)
    torch.testing.assert_close(out, inp @ weight.t())
    out.sum().backward()
    torch.testing.assert_close(inp.grad, torch.ones(2, 3, 5) @ weight.detach())


# --- patch_grouped_gemm -----------------------------------------------------------------------


def test_grouped_gemm_still_needed(unpatched_failures):
    """Without the grouped_gemm package (CUDA only), megatron's GroupedMLP refuses to run."""
    assert_fails(unpatched_failures, "grouped_gemm", "AssertionError",
                 "Grouped GEMM is not available")


@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_gemm_patched(patched, trans_b):
    """gmm multiplies each run of rows by its expert's matrix (an expert may get no rows), with
    gradients: against every row times its own expert's matrix, gathered."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    assert gg.grouped_gemm_is_available() and gg.ops.gmm is cpu.grouped_matmul
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor([2, 0, 3, 1])
    a = torch.randn(6, 5, generator=gen, requires_grad=True)
    b = torch.randn(4, *((7, 5) if trans_b else (5, 7)), generator=gen, requires_grad=True)
    out = gg.ops.gmm(a, b, sizes, trans_b=trans_b)
    experts = torch.repeat_interleave(torch.arange(4), sizes)
    per_row = b[experts].transpose(1, 2) if trans_b else b[experts]
    want = torch.einsum("tk,tkn->tn", a, per_row)
    torch.testing.assert_close(out, want)
    grad = torch.randn(6, 7, generator=gen)
    got_grads = torch.autograd.grad(out, (a, b), grad)
    want_grads = torch.autograd.grad(want, (a, b), grad)
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected)
    assert not got_grads[1][1].any()  # the expert with no rows gets no gradient


# --- apply() ----------------------------------------------------------------------------------


def test_apply_is_idempotent(patched):
    """A second apply() applies nothing new and returns the same names."""
    proxy, stream_class = moe_utils.torch, torch.cuda.Stream
    assert cpu.apply() == patched
    assert sorted(patched) == sorted(p.__name__ for p, _ in cpu.PATCHES)
    assert moe_utils.torch is proxy and torch.cuda.Stream is stream_class


def test_apply_with_cuda_available(unpatched_failures, monkeypatch):
    """With CUDA available only the patches needed on any GPU without TE apply."""
    assert unpatched_failures["applied_with_cuda"] == ["patch_moe_utils_te_general_gemm",
                                                       "patch_checkpoint_without_output_fp8"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for patch, needed in cpu.PATCHES:
        if needed is cpu.cuda_missing:
            assert not needed(), patch.__name__


def test_every_patch_is_covered():
    """Each entry of PATCHES has its tests here, and each of those tests exists."""
    assert set(COVERAGE) == {patch.__name__ for patch, _ in cpu.PATCHES}
    import test_compat_cpu_collectives as on_two_ranks
    import test_compat_cpu_recompute as recompute

    defined = {name for name in [*globals(), *vars(on_two_ranks), *vars(recompute)]
               if name.startswith("test_")}
    for patch, tests in COVERAGE.items():
        missing = set(tests) - defined
        assert not missing, f"{patch}: {missing}"
