"""megatron-core without parm_trainer/compat/cpu.py's patches, in a process that never applied
them: which of the calls the patches fix still fail here. Prints one JSON line
(tests/test_compat_cpu.py, through conftest.python)."""
import json, traceback, types, warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer.optimizer import FP32Optimizer
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.utils import get_default_causal_mask
from megatron.core.utils import GlobalMemoryBuffer, local_multi_tensor_l2_norm
from parm_trainer.compat import cpu


def failure(fn):
    """'Type: message | megatron-core source line it failed at', or None when fn runs."""
    try:
        fn()
    except Exception as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        megatron = [f for f in frames if "/megatron/" in f.filename] or frames
        return f"{type(exc).__name__}: {exc} | {megatron[-1].line}"
    return None


def fp32_param_with_grad():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    return param


def dispatcher_state():
    """The attributes MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize reads."""
    return types.SimpleNamespace(
        drop_and_pad=False, cuda_dtoh_point="p", cuda_sync_point="p",
        cuda_dtoh_stream=None, input_splits=torch.tensor([1, 2]),
        output_splits=torch.tensor([2, 1]), output_splits_tp=None, num_out_tokens=3,
        num_local_experts=1, config=types.SimpleNamespace(moe_permute_fusion=False),
    )


sp_config = TransformerConfig(
    num_layers=1, hidden_size=8, num_attention_heads=2,
    tensor_model_parallel_size=2, sequence_parallel=True,
)
errors = {
    "rng_tracker_add": failure(lambda: mrandom.CudaRNGStatesTracker().add("probe", 1)),
    "rng_manual_seed": failure(lambda: mrandom.model_parallel_cuda_manual_seed(
        1, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)),
    "rng_checkpoint": failure(lambda: mrandom.checkpoint(torch.sin, False,
                                                         torch.ones(2, requires_grad=True))),
    "torch_norm_sequence_parallel": failure(lambda: WrappedTorchNorm(sp_config, 8)),
    "current_device": failure(lambda: torch.cuda.current_device()),
    "global_memory_buffer": failure(
        lambda: GlobalMemoryBuffer().get_tensor((2,), torch.float, "probe")),
    "stream": failure(lambda: torch.cuda.Stream()),
    "event": failure(lambda: torch.cuda.Event()),
    "synchronize": failure(lambda: torch.cuda.synchronize()),
    "dtoh_and_synchronize": failure(lambda: MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize(
        dispatcher_state(), "p")),
    "causal_mask": failure(lambda: get_default_causal_mask(4)),
    "fp32_optimizer": failure(lambda: FP32Optimizer(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), OptimizerConfig(lr=0.1),
        None)),
    "l2_norm": failure(lambda: local_multi_tensor_l2_norm(1, None, [[torch.ones(2)]], False)),
    "tensor_cuda": failure(lambda: torch.ones(2).cuda()),
    "te_general_gemm": failure(lambda: moe_utils.RouterGatingLinearFunction.apply(
        torch.ones(2, 4), torch.ones(3, 4), None, torch.float32)),
    "checkpoint_without_output": failure(lambda: mrandom.CheckpointWithoutOutputFunction.apply(
        torch.sin, mrandom.CheckpointWithoutOutput(), torch.ones(2, requires_grad=True))),
    "grouped_gemm": failure(lambda: __import__(
        "megatron.core.transformer.moe.grouped_gemm_util", fromlist=["x"]
    ).assert_grouped_gemm_is_available()),
    "clip_type_assert": failure(
        lambda: clip_grad_by_total_norm_fp32([fp32_param_with_grad()], 1.0, 0.5)),
}

# The split sizes the dispatcher hands to all_to_all_single: streams and events patched (the
# dispatcher needs them before it gets there), maybe_move_tensor_to_cpu not.
cpu.patch_cuda_device_streams_events()
state = dispatcher_state()
state.cuda_dtoh_stream = torch.cuda.Stream()
MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize(state, "p")
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
errors["all_to_all_split_sizes"] = failure(lambda: dist.all_to_all_single(
    torch.empty(3), torch.ones(3), output_split_sizes=state.output_splits,
    input_split_sizes=state.input_splits))
dist.destroy_process_group()

# A machine with CUDA: only the patch whose condition does not depend on CUDA applies.
torch.cuda.is_available = lambda: True
print(json.dumps({"errors": errors, "applied_with_cuda": cpu.apply()}))
