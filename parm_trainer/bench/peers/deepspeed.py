"""DeepSpeed's MoE layer (deepspeed.moe.layer.MoE) as a peer of Parm's schedules, on the layout
megatron's parallel_state holds, with the full weights of parm_trainer.bench.weights.full_weights.
Nothing here imports DeepSpeed until a function is called.

    ok, reason = available()                 # (False, "DeepSpeed is not installed ...") without .[peers]
    apply_adapters()                          # once, inside the benchmark only
    layer = build("ted", args, weights, device)          # or PeerCannotRun(reason)
    out, aux = forward(layer, x_local)        # x_local: this rank's [S(/MP under SP), B, M]
    ((out * g_local).sum() + args.moe_aux_loss_coeff * aux).backward()

Check (4 ranks; deepspeed_check.py):  .venv/bin/python -m torch.distributed.run \
                      --nproc-per-node 4 tools/deepspeed_peer.py --check

Three modes (ep, dedup, ted: DeepSpeed's own names), the process groups DeepSpeed builds and
how they are checked against megatron's, and how its routing, aux loss, capacity and gradients
compare with reference.py: docs/peers.md.
"""

from __future__ import annotations

import math

import torch

from parm_trainer.bench.peers import DEEPSPEED_MODES, PeerCannotRun

MODES = DEEPSPEED_MODES
NOT_INSTALLED = "DeepSpeed is not installed (pip install .[peers])"


def available():
    """(True, "DeepSpeed <version>") or (False, the one-line reason)."""
    try:
        import deepspeed
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] == "deepspeed":
            return False, NOT_INSTALLED
        return False, f"DeepSpeed does not import: {error}"
    except Exception as error:  # noqa: BLE001 - any import failure is the reason
        return False, f"DeepSpeed does not import: {type(error).__name__}: {error}"
    return True, f"DeepSpeed {deepspeed.__version__}"


# --- adapters -----------------------------------------------------------------------------
# Applied only by the benchmark (and --check), each once, each for one thing DeepSpeed 0.19.8
# does on CPU + gloo that stops or breaks a run.

_APPLIED: list = []


def _no_shm_op():
    return None


def apply_adapters() -> list:
    """Apply the adapters (idempotent); returns their names."""
    if _APPLIED:
        return list(_APPLIED)
    import importlib

    from deepspeed.moe import sharded_moe

    # (`import deepspeed.comm.torch as m` binds the torch package: deepspeed.comm has a `torch`)
    ds_torch = importlib.import_module("deepspeed.comm.torch")

    # 1. deepspeed/comm/torch.py TorchBackend.__init__ calls build_shm_op(), which on the CPU
    #    accelerator JIT-compiles the ShareMemCommBuilder C++ op (g++ + ninja, into
    #    ~/.cache/torch_extensions; about a minute on the first start, and a failure without a
    #    compiler). The op serves only inference_all_reduce, which the MoE layer never calls:
    #    turn it off.
    ds_torch.build_shm_op = _no_shm_op
    _APPLIED.append("no_shm_comm_op")

    # 2. deepspeed/moe/mappings.py _gather_tokens all-gathers into a flat 1-D buffer
    #    (torch.empty(world * input.numel())); gloo's all_gather_into_tensor rejects an output
    #    that is not (world * d0, ...) of the input's shape. View the same buffer as
    #    (world * d0, *input.shape[1:]): the same bytes in the same rank-major order.
    original_gather = ds_torch.TorchBackend.all_gather_into_tensor

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        if (output_tensor.dim() == 1 and input_tensor.dim() > 1 and output_tensor.is_contiguous()
                and output_tensor.numel() % max(input_tensor.numel(), 1) == 0):
            world = output_tensor.numel() // max(input_tensor.numel(), 1)
            output_tensor = output_tensor.view(world * input_tensor.shape[0],
                                               *input_tensor.shape[1:])
        return original_gather(self, output_tensor, input_tensor, group=group, async_op=async_op)

    ds_torch.TorchBackend.all_gather_into_tensor = all_gather_into_tensor
    _APPLIED.append("gloo_all_gather_2d_output")

    # 3. deepspeed/moe/sharded_moe.py top1gating/top2gating/topkgating with drop_tokens=False pad
    #    the capacity to a multiple of the TP size only when
    #    groups._get_expert_model_parallel_world_size() == 1, i.e. not under TED; MOELayer then
    #    narrows the capacity dim over TP (mappings.py _drop_tokens) and asserts
    #    "input dimension 1 (C) is not divisible by tensor parallel world size". Round the
    #    dropless capacity up to a multiple of the TP size (extra slots stay empty; nothing is
    #    dropped, so the result is unchanged).
    original_gate = sharded_moe.TopKGate.forward

    def gate_forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
        out = original_gate(self, input, used_token, sparse_routes, use_tutel)
        from deepspeed.utils import groups
        from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

        tp = bwc_tensor_model_parallel_world_size(groups.mpu)
        if sparse_routes and not self.drop_tokens and tp > 1:
            capacity = out[1]
            rounded = (torch.div(capacity + tp - 1, tp, rounding_mode="floor") * tp
                       if torch.is_tensor(capacity) else math.ceil(capacity / tp) * tp)
            out = (out[0], rounded, *out[2:])
        return out

    sharded_moe.TopKGate.forward = gate_forward
    _APPLIED.append("ted_dropless_capacity_multiple_of_tp")
    return list(_APPLIED)


# --- the peer -----------------------------------------------------------------------------

class _Shared:
    """Holds a process group through DeepSpeed's copy.deepcopy of the expert module."""

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self


class _Expert(torch.nn.Module):
    """fc2 @ gelu(fc1 @ x), no biases (reference.py's expert). With a group (ted): fc1 holds
    H / MP rows and fc2 H / MP columns, the input is copied into the group (its gradient
    all-reduced) and the output all-reduced over it, as Megatron-DeepSpeed's
    ParallelMLP(moe=True, enable_expert_tensor_parallelism=True)."""

    def __init__(self, hidden, ffn_local, group=None):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, ffn_local, bias=False)
        self.fc2 = torch.nn.Linear(ffn_local, hidden, bias=False)
        self.group = _Shared(group)

    def forward(self, x):
        from megatron.core.tensor_parallel import mappings

        group = self.group.value
        if group is not None:
            x = mappings.copy_to_tensor_model_parallel_region(x, group=group)
        y = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        if group is not None:
            y = mappings.reduce_from_tensor_model_parallel_region(y, group=group)
        return y


def _ranks(group):
    return sorted(torch.distributed.get_process_group_ranks(group))


def _check_layout(mode, args):
    """Refuse, before any collective (the same answer on every rank), what the mode cannot run."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose from {', '.join(MODES)}")
    mp, esp = args.tensor_model_parallel_size, args.expert_tensor_parallel_size
    pp = args.pipeline_model_parallel_size
    if pp != 1:
        raise PeerCannotRun(f"one MoE layer without pipeline stages: needs "
                            f"--pipeline-model-parallel-size 1 (got {pp})")
    if mode == "ep" and (mp != 1 or esp != 1):
        raise PeerCannotRun(f"DeepSpeed ep (expert parallel only, no mpu) knows no tensor "
                            f"parallelism: needs MP 1 and ESP 1 (got MP {mp}, ESP {esp}); "
                            "with MP > 1 it is the dedup mode")
    if mode == "dedup" and esp != 1:
        raise PeerCannotRun(f"DeepSpeed dedup keeps whole experts (no expert tensor "
                            f"parallelism): needs ESP 1 (got {esp})")
    if mode == "ted" and esp != mp:
        raise PeerCannotRun(f"DeepSpeed TED shards each expert over the MP group: needs ESP "
                            f"equal to MP (got ESP {esp}, MP {mp})")
    factor = args.moe_expert_capacity_factor
    if factor is not None and mode != "ep" and mp > 1:
        tokens = args.seq_length * args.micro_batch_size  # one gate call: the MP group's tokens
        k, experts = args.moe_router_topk, args.num_experts
        # sharded_moe._capacity with min_capacity 0, same operation order
        capacity = int(torch.ceil(torch.tensor(tokens / experts) * torch.tensor(factor * k)))
        if capacity % mp:
            raise PeerCannotRun(
                f"DeepSpeed {mode} splits the capacity over MP (deepspeed/moe/mappings.py "
                f"_drop_tokens asserts divisibility): capacity {capacity} (factor {factor}, "
                f"{tokens} tokens, top-{k}, {experts} experts) is not divisible by MP {mp}")


def _reset_deepspeed_groups():
    """Forget DeepSpeed's group registry (keyed only by ep_size, so dedup and ted of one size
    would share the first one built) and its TP globals; the groups themselves stay alive for
    modules already built (they hold their handles)."""
    from deepspeed.utils import groups

    groups._release_process_group_references(None)


def _ensure_comm():
    """deepspeed.comm over the process group torch.distributed already runs (gloo on CPU: the
    CPU accelerator's communication_backend_name() falls back to gloo without oneCCL)."""
    import deepspeed
    from deepspeed import comm as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(),
                                   dist_init_required=False, verbose=False)


def build(mode, args, weights, device):
    """deepspeed.moe.layer.MoE for `mode` on megatron's current layout (layout.set_layout done),
    holding this rank's shards of `weights` (gate [E, M], fc1 [E, H, M], fc2 [E, M, H])."""
    ok, reason = available()
    if not ok:
        raise PeerCannotRun(reason)
    _check_layout(mode, args)
    apply_adapters()
    _ensure_comm()
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups
    from megatron.core import parallel_state

    mp = args.tensor_model_parallel_size
    experts, hidden, ffn = args.num_experts, args.hidden_size, args.moe_ffn_hidden_size
    ted = mode == "ted"
    tp_group = parallel_state.get_tensor_model_parallel_group() if mode != "ep" else None
    _reset_deepspeed_groups()
    groups.mpu = parallel_state if mode != "ep" else None
    factor = args.moe_expert_capacity_factor
    layer = MoE(hidden_size=hidden,
                expert=_Expert(hidden, ffn // mp if ted else ffn, tp_group if ted else None),
                num_experts=experts,
                ep_size=args.expert_model_parallel_size,
                k=args.moe_router_topk,
                capacity_factor=1.0 if factor is None else factor,
                eval_capacity_factor=1.0 if factor is None else factor,
                min_capacity=0,
                noisy_gate_policy=None,
                drop_tokens=factor is not None,
                use_rts=False,
                enable_expert_tensor_parallelism=ted,
                top2_2nd_expert_sampling=False)
    layer.set_deepspeed_parallelism()

    name = layer.expert_group_name
    ds_ep = _ranks(groups._get_expert_parallel_group(name))
    mg_ep = _ranks(parallel_state.get_expert_model_parallel_group())
    ds_edp = _ranks(groups._get_expert_data_parallel_group(name))
    mg_edp = _ranks(parallel_state.get_expert_data_parallel_group())
    mismatch = torch.tensor([float(ds_ep != mg_ep or ds_edp != mg_edp)])
    torch.distributed.all_reduce(mismatch, op=torch.distributed.ReduceOp.MAX)
    if mismatch.item():
        raise PeerCannotRun(f"DeepSpeed {mode} builds expert groups unlike megatron's (rank "
                            f"{torch.distributed.get_rank()}: EP {ds_ep} vs {mg_ep}, expert-DP "
                            f"{ds_edp} vs {mg_edp})")

    # This rank's shards: DeepSpeed's EP rank j holds experts j * local ... (AlltoAll order).
    ep_rank = groups._get_expert_parallel_rank(name)
    local = layer.num_local_experts
    if ted:
        h = ffn // mp
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        rows = slice(tp_rank * h, (tp_rank + 1) * h)
    else:
        rows = slice(0, ffn)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(weights["gate"])
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            e = ep_rank * local + i
            expert.fc1.weight.copy_(weights["fc1"][e, rows, :])
            expert.fc2.weight.copy_(weights["fc2"][e, :, rows])
    layer.to(device)
    layer.train()
    layer.parm_peer = {"mode": mode, "mpu": groups.mpu,
                       "expert_tp": groups.expert_tensor_parallel_world_size,
                       "sp": bool(args.sequence_parallel) and mp > 1, "tp_group": tp_group,
                       "shards": [(ep_rank * local + i, rows) for i in range(local)]}
    return layer


def forward(layer, x):
    """(output, aux) for this rank's input x [S, B, M] ([S / MP, B, M] under sequence
    parallelism); output has x's shape, aux is DeepSpeed's l_aux before the coefficient.

    DeepSpeed reads groups.mpu and its expert-TP size as module globals in the forward AND in
    the backward (mappings.py, sharded_moe.py): this sets them to this layer's, so its backward
    must run before another peer's forward (as the benchmark's step does)."""
    from deepspeed.utils import groups
    from megatron.core.tensor_parallel import mappings

    state = layer.parm_peer
    groups.mpu = state["mpu"]
    groups.expert_tensor_parallel_world_size = state["expert_tp"]
    if state["sp"]:
        # DeepSpeed's dedup/ted expect every MP rank to hold the same tokens: gather the
        # sequence shards (every MP rank then computes the full gradient: keep its own slice),
        # and hand back this rank's shard (its gradient is all-gathered in the backward).
        x = mappings.gather_from_sequence_parallel_region(
            x, tensor_parallel_output_grad=False, group=state["tp_group"])
    out, aux, _ = layer(x)
    if state["sp"]:
        out = mappings.scatter_to_sequence_parallel_region(out, group=state["tp_group"])
    return out, aux
