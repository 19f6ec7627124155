"""python tools/bench_moe_layer.py --nproc 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --num-experts 4 --moe-router-topk 2 --hidden-size 64 --moe-ffn-hidden-size 128 --seq-length 64 --micro-batch-size 2 --schedules baseline,s1,s2,megatron --iters 10 --warmup 2 --json bench.json

One MoE layer, forward and backward, under several schedules in one launch: Parm's baseline
(DeepSpeed-MoE TED), s1 and s2 (ParmMoELayer; --moe-parm-chunks R pipelines them, 0 lets the
cost model choose R), auto (the cost model's choice of s1/s2, shown as auto=s1/r4), and
megatron-core's own MoELayer: "megatron" with --moe-token-dispatcher-type, or the peers
"megatron-alltoall" and "megatron-allgather". --ratio-to NAME sets the ratio column's divisor.
Every schedule gets the same full weights and the same data, and is checked against the
single-process reference (parm_trainer/moe/reference.py); it is timed, and its collectives'
bytes are read from parm_trainer.moe.comm.LEDGER.

With --nproc N the tool starts N ranks itself (torchrun, gloo on CPU, nccl on GPU); without it,
it is one rank of a job started by torchrun (so the same tool measures multi-node layouts).

Layer: router logits = x @ gate.T; each token picks its top-k logits and its routing
probabilities are the softmax over those k logits (megatron-core's default router); expert
e(x) = fc2[e] @ gelu(fc1[e] @ x), no biases; output = sum over the chosen experts of
probability * expert(x). Load-balancing loss: megatron-core's switch aux loss, coeff * E /
(k * T^2) * sum_e count_e * sum_t softmax(logits)[t, e]; the backward objective is
sum(out * output_grad) + coeff * aux.

Data. Weights are drawn in full on every rank from --seed (gate [E, M] and fc1 [E, H, M] with
std --init-method-std, fc2 [E, M, H] with std / sqrt(2 * --num-layers)) and each rank keeps its
EP/ESP slice. Each data-parallel replica d draws its own full input [S, B, M] and output
gradient from (--seed, d); a rank feeds its slice (the sequence shard of its MP rank under
--sequence-parallel, else all of it).

Checks (max abs difference to the reference, max over ranks):
  output, input grad   each rank's result gathered over MP to the full [S, B, M] of its replica
                       and compared with the reference on that replica's data
  gate grad            summed over MP where megatron marks it sequence-parallel (as its
                       finalize_model_grads does), then over the data-parallel group; compared
                       with the reference's gradient summed over all replicas
  expert grads         each rank's fc1/fc2 shard, summed over the expert-data-parallel group,
                       against the same slice of the reference's gradient summed over replicas
                       (every element of the full [E, H, M] / [E, M, H] is some rank's slice)
  aux loss             the tracked load_balancing_loss (before the coefficient), summed over
                       the group megatron-core reduces it over, against the replica's reference
Without DDP nothing averages over replicas, so sums are compared with sums.
With a capacity factor the reference counts capacity per gate call as the schedule does
(s1: one call per MP rank; megatron under --sequence-parallel: one per sequence shard).

Timing: the median of --iters iterations after --warmup, per rank, each iteration started by a
barrier on all ranks (untimed; torch.cuda.synchronize on GPU), the schedules' iterations
interleaved (one of each in turn, so a drift of the machine's speed touches all alike; each turn
starting one schedule later, so none always follows the same one): forward, backward and their
sum per iteration, reported for rank 0 and as the max over ranks. A row's time (fwd+bwd, the
ratio, x floor) is the max over ranks of the median sum: a rank slow in the forward waits less
in the backward, so the sum of the two phases' maxima would count one wait twice. Bytes: sent
per rank by collective kind (received is the same) for one iteration, forward and backward,
from the ledger (null for megatron, whose collectives the ledger does not see).

--json OUT: the config and, per schedule, status (ok or skipped, with the reason), times, bytes
and differences. --dump DIR (DP replica 0): input.pt and output_grad.pt ([S*B, M], sequence-
major, i.e. [S, B, M].reshape), weights.pt (gate, fc1, fc2, activation, router) and
<schedule>_output.pt / <schedule>_input_grad.pt (full, same order).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
import warnings

# Run from a checkout without installing: make parm_trainer importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# megatron-core warns about optional GPU extensions at import and about MP without sequence
# parallelism (which concerns its own dispatcher, reported here as a skip), torch about the
# names of collectives.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|is deprecated|sequence "
                                          "parallelism must be used|Disabling sequence parallel)")
from parm_trainer.arguments import parse_args  # noqa: E402
from parm_trainer.moe.reference import ACTIVATION, ROUTER, ROUTER_PRE_SOFTMAX  # noqa: E402
from parm_trainer.progress import Progress  # noqa: E402

from deepspeed_peer import PeerCannotRun  # noqa: E402 (tools/; imports DeepSpeed only when used)

SCHEDULE_NAMES = ("baseline", "s1", "s2", "auto", "megatron", "megatron-alltoall",
                  "megatron-allgather", "deepspeed-ep", "deepspeed-dedup", "deepspeed-ted")
KINDS = ("alltoall", "allgather", "reducescatter", "allreduce")
DIFF_KEYS = ("output", "input_grad", "gate_grad", "expert_grad", "aux_loss")
TOOL_HELP = f"""\
bench_moe_layer: one MoE layer, forward and backward, under several schedules, each checked
against parm_trainer/moe/reference.py, timed, and its collectives' bytes counted.
Router:     logits = x @ gate.T; routing probabilities = {ROUTER} of each
            token (megatron-core's default: score function "softmax"), or with
            --moe-router-pre-softmax (needed for top-1) the softmax over all E logits at
            the top k; dropless unless --moe-expert-capacity-factor.
Activation: {ACTIVATION} (torch.nn.functional.gelu, megatron-core's default); no biases.
Aux loss:   coeff * E / (k * T^2) * sum_e count_e * sum_t softmax(logits)[t, e] (megatron-core's
            switch load-balancing loss). fp32 only."""


class ToolError(ValueError):
    """Flags the tool cannot run with; the message names them."""


# --- flags ---------------------------------------------------------------------------------

def add_tool_args(parser: argparse.ArgumentParser) -> None:
    parser.description = TOOL_HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("bench_moe_layer")
    # Rows run at the depth given (--moe-parm-chunks, 1 unless given; 0: chosen as auto does),
    # not at the training default of a depth chosen at start-up.
    parser.set_defaults(moe_parm_chunks=1)
    g.add_argument("--nproc", type=int, default=None,
                   help="Start this many ranks on this machine (torchrun); without it the tool "
                        "is one rank of a job torchrun started.")
    g.add_argument("--schedules", default="baseline,s1,s2,megatron",
                   help=f"Comma-separated schedules to run, from {','.join(SCHEDULE_NAMES)}. "
                        "One that cannot run the layout is reported as skipped, with the reason.")
    g.add_argument("--ratio-to", default="baseline",
                   help="The entry of --schedules the ratio column divides by (default baseline).")
    g.add_argument("--iters", type=int, default=10, help="Timed iterations (median reported).")
    g.add_argument("--warmup", type=int, default=2, help="Untimed iterations first.")
    g.add_argument("--json", default=None, help="Write the results here (rank 0).")
    g.add_argument("--step-times", action="store_true",
                   help="After the timed iterations, time each Parm row's plan steps as "
                        "--timing-log-level 2 does in training (--iters more iterations) and "
                        "print their sum beside the row's fwd+bwd.")
    g.add_argument("--dump", default=None,
                   help="Write full input, output gradient, weights and each schedule's output "
                        "and input gradient of data-parallel replica 0 here (torch.save).")
    g.add_argument("--inter-node-rate", default=None,
                   help="The rate of one node's network link, for the link-time floor column: "
                        "a tc rate (200mbit, 25mbps) or a profile JSON from "
                        "tools/calibrate_comm.py run across nodes (its node link AlltoAll rate).")
    # Hidden: a JSON file holding a list of {"name": ..., "argv": [...]}; every entry is run in
    # this one launch (the world size stays, the layout may change), --json gets {"runs": [...]}.
    g.add_argument("--configs", default=None, help=argparse.SUPPRESS)


def parse(argv, world_size=None):
    args = parse_args(argv, add_tool_args, world_size=world_size)
    args.schedule_list = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in args.schedule_list if s not in SCHEDULE_NAMES]
    if unknown or not args.schedule_list:
        raise ToolError(f"--schedules: unknown {unknown}; choose from {','.join(SCHEDULE_NAMES)}")
    if args.iters < 0 or args.warmup < 0:
        raise ToolError("--iters and --warmup must not be negative")
    if args.swiglu:
        raise ToolError("--swiglu: the reference implements the gelu expert only")
    if args.bf16 and any(name.startswith("deepspeed") for name in args.schedule_list):
        raise ToolError("--bf16: the DeepSpeed peers run in fp32 here")
    if args.moe_z_loss_coeff:
        raise ToolError("--moe-z-loss-coeff: the reference has no z-loss")
    if args.moe_router_load_balancing_type not in ("aux_loss", "none"):
        raise ToolError("--moe-router-load-balancing-type: the reference implements aux_loss")
    if args.moe_router_load_balancing_type == "none":
        args.moe_aux_loss_coeff = 0.0
    args.link_bytes_per_s = link_rate(args.inter_node_rate) if args.inter_node_rate else None
    if args.num_experts is None and not args.configs:
        raise ToolError("--num-experts is required")
    args.disable_bias_linear = True  # experts and router without biases, as the reference
    args.hidden_dropout = args.attention_dropout = 0.0
    return args


def link_rate(value: str) -> float:
    """Bytes per second of one node's link: a tc rate, or a calibrated profile's node link
    AlltoAll rate."""
    if value.endswith(".json"):
        try:
            with open(value) as f:
                fit = json.load(f)["fit"]["alltoall"]["inter"]
            return float(fit["node_link_GBps"]) * 1e9
        except (OSError, KeyError, TypeError, ValueError) as error:
            raise ToolError(f"--inter-node-rate {value}: no node link rate in it ({error!r}); "
                            "calibrate across nodes with tools/calibrate_comm.py") from None
    from emulated_cluster import RATE, rate_bytes_per_s

    if not RATE.match(value):
        raise ToolError(f"--inter-node-rate {value!r}: a rate such as 200mbit, or a profile JSON")
    return rate_bytes_per_s(value)


def _node_of(rank: int) -> int:
    return rank // int(os.environ.get("LOCAL_WORLD_SIZE", torch.distributed.get_world_size()))


def _cross_node_bytes(local_bytes: dict, groups: dict) -> int:
    """Of the bytes this rank sent (ledger keys kind/group/phase), those that left its node:
    each collective's bytes times the share of the group's other ranks on other nodes."""
    me, total = torch.distributed.get_rank(), 0.0
    for key, sent in local_bytes.items():
        members = torch.distributed.get_process_group_ranks(groups[key.split("/")[1]])
        if len(members) > 1:
            remote = sum(_node_of(r) != _node_of(me) for r in members)
            total += sent * remote / (len(members) - 1)
    return int(total)


def _busiest_node(per_rank: list) -> int:
    """The largest sum of per_rank over the ranks of one node."""
    nodes = {}
    for rank, value in enumerate(per_rank):
        nodes[_node_of(rank)] = nodes.get(_node_of(rank), 0) + value
    return max(nodes.values())


# --- launcher ------------------------------------------------------------------------------

def launch(argv, nproc: int) -> int:
    """Re-run this tool as `nproc` ranks under torchrun on this machine."""
    from parm_trainer.launch import relaunch

    return relaunch(__file__, argv, nproc)


# --- the worker ----------------------------------------------------------------------------

def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _generator(*key) -> torch.Generator:
    seed = 0
    for part in key:
        seed = (seed * 1_000_003 + int(part)) % (2 ** 62)
    return torch.Generator().manual_seed(seed)


def full_weights(args):
    """gate [E, M], fc1 [E, H, M], fc2 [E, M, H], the same on every rank."""
    e, m, h = args.num_experts, args.hidden_size, args.moe_ffn_hidden_size
    std = args.init_method_std
    gen = _generator(args.seed, 1)
    gate = torch.empty(e, m).normal_(0.0, std, generator=gen)
    fc1 = torch.empty(e, h, m).normal_(0.0, std, generator=gen)
    fc2 = torch.empty(e, m, h).normal_(0.0, std / math.sqrt(2.0 * args.num_layers), generator=gen)
    return {k: _as_layer_sees(v, args) for k, v in (("gate", gate), ("fc1", fc1), ("fc2", fc2))}


def _as_layer_sees(t, args):
    """With --bf16 the layer holds bf16 values: the fp32 reference gets the same values, so
    the difference measures the bf16 computation, not the rounding of its inputs."""
    return t.bfloat16().float() if args.bf16 else t


def replica_data(args, dp_index: int):
    """Full input and output gradient [S, B, M] of data-parallel replica dp_index."""
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    gen = _generator(args.seed, 2, dp_index)
    return (_as_layer_sees(torch.randn(shape, generator=gen), args),
            _as_layer_sees(torch.randn(shape, generator=gen), args))


def _layout_key(args):
    return (args.tensor_model_parallel_size, args.expert_model_parallel_size,
            args.expert_tensor_parallel_size, args.pipeline_model_parallel_size)


_CURRENT_LAYOUT = [None]


def set_layout(args) -> None:
    """Start torch.distributed on first use; (re)build megatron's groups for args' layout."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from parm_trainer.parallel import initialize_distributed, reset_model_parallel

    key = _layout_key(args)
    if _CURRENT_LAYOUT[0] != key:
        if parallel_state.model_parallel_is_initialized():
            reset_model_parallel()
        initialize_distributed(args)
        _CURRENT_LAYOUT[0] = key
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)


def build_layer(name, config, args):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from parm_trainer.moe.layer import ParmMoELayer

    spec = get_moe_module_spec(use_te=False, num_experts=args.num_experts, moe_grouped_gemm=False)
    if name == "megatron":
        layer = MoELayer(config, spec.submodules, layer_number=1)
    else:
        layer = ParmMoELayer(config, spec.submodules, layer_number=1, schedule=name,
                             chunks=args.moe_parm_chunks, exchange=args.moe_parm_exchange)
    layer.set_layer_number(1)  # as TransformerLayer does; the router tracks its aux loss by it
    return layer


def load_weights(layer, weights, args):
    """Copy this rank's EP/ESP slices of the full weights into the layer."""
    from megatron.core import parallel_state

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    esp_rank = parallel_state.get_expert_tensor_parallel_rank()
    esp = args.expert_tensor_parallel_size
    local = args.num_experts // args.expert_model_parallel_size
    h = args.moe_ffn_hidden_size // esp
    rows = slice(esp_rank * h, (esp_rank + 1) * h)
    with torch.no_grad():
        layer.router.weight.copy_(weights["gate"])
        for i, expert in enumerate(layer.experts.local_experts):
            e = ep_rank * local + i
            expert.linear_fc1.weight.copy_(weights["fc1"][e, rows, :])
            expert.linear_fc2.weight.copy_(weights["fc2"][e, :, rows])
    return [(ep_rank * local + i, rows) for i in range(len(layer.experts.local_experts))]


class Replica:
    """This rank's replica data and the reference results on it (cached per gate-call count)."""

    def __init__(self, args, weights, device):
        from megatron.core import parallel_state

        self.args, self.device = args, device
        self.dp_index = parallel_state.get_data_parallel_rank()
        self.mp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.mp_size = args.tensor_model_parallel_size
        x, g = replica_data(args, self.dp_index)
        self.input, self.output_grad = x.to(device), g.to(device)
        self.weights = {k: v.to(device) for k, v in weights.items()}
        self._refs = {}

    def local(self, full, sequence_parallel: bool):
        if not sequence_parallel:
            return full.clone()
        return full.chunk(self.mp_size, dim=0)[self.mp_rank].contiguous()

    def reference(self, gate_calls: int, aux: bool = True):
        """Reference output, input grad and raw aux on this replica; weight grads summed over
        all replicas (an all-reduce over the DP group: every rank must ask for the same keys in
        the same order)."""
        from megatron.core import parallel_state

        from parm_trainer.moe.reference import moe_reference

        args = self.args
        if args.moe_expert_capacity_factor is None:
            gate_calls = 1
        coeff = args.moe_aux_loss_coeff if aux else 0.0
        if (gate_calls, coeff) not in self._refs:
            s, b, m = self.input.shape
            x = self.input.reshape(s * b, m).clone().requires_grad_()
            w = {k: v.clone().requires_grad_() for k, v in self.weights.items()}
            ref = moe_reference(x, w["gate"], w["fc1"], w["fc2"], args.moe_router_topk,
                                aux_loss_coeff=coeff,
                                capacity_factor=args.moe_expert_capacity_factor,
                                gate_calls=gate_calls, pre_softmax=args.moe_router_pre_softmax)
            objective = (ref.output * self.output_grad.reshape(s * b, m)).sum()
            if coeff:
                objective = objective + ref.aux_loss
            objective.backward()
            grads = {k: v.grad.detach().clone() for k, v in w.items()}
            dp_group = parallel_state.get_data_parallel_group()
            for k in ("gate", "fc1", "fc2"):
                torch.distributed.all_reduce(grads[k], group=dp_group)
            self._refs[(gate_calls, coeff)] = {
                "output": ref.output.detach().view(s, b, m),
                "input_grad": x.grad.detach().view(s, b, m),
                "aux_loss": ref.raw_aux_loss.detach(),
                "routing_map": ref.routing_map.cpu(),
                **{f"{k}_grad_total": v for k, v in grads.items()},
            }
        return self._refs[(gate_calls, coeff)]


def _gather_mp(local, sequence_parallel):
    from megatron.core import parallel_state

    if not sequence_parallel or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return local
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=0)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


def _gate_calls(name, args):
    if name == "s1":
        return args.tensor_model_parallel_size
    if name == "megatron" and args.sequence_parallel:
        return args.tensor_model_parallel_size
    return 1


def _tracked_aux(device):
    """The tracked load_balancing_loss of layer 1, summed over its reduce group; None if the
    layer tracked none."""
    from megatron.core.transformer.moe import moe_utils

    entry = moe_utils.get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    if entry is None:
        return None
    value = entry["values"][0].detach().clone().to(device)
    if entry.get("reduce_group") is not None:
        torch.distributed.all_reduce(value, group=entry["reduce_group"])
    return value


def _clear_tracker():
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.pop("load_balancing_loss", None)


def _ledger_snapshot(field="sent"):
    from parm_trainer.moe.comm import LEDGER

    return {key: row[field] for key, row in LEDGER.totals(per_phase=True).items()}


def _unique_payload(args, replica) -> dict:
    """{node: bytes} this rank's tokens make leave each node at the least, from the routing
    itself: each of its tokens (its 1/MP block of the replica's, as s1 splits them) once to
    every other node holding one of its experts (EP ranks of this rank's EP group), hidden x
    4 bytes plus 4 bytes per routing weight that travels, out and back, forward and backward.
    A token's outbound payload and the backward's gradient of its return leave its own node;
    the return and the gradient of the payload leave the expert's node."""
    from megatron.core import parallel_state

    hidden, experts = args.hidden_size, args.num_experts
    routing = replica.reference(gate_calls=replica.mp_size)["routing_map"]  # s1's gate calls
    mine = routing.chunk(replica.mp_size)[replica.mp_rank]
    ep_ranks = torch.distributed.get_process_group_ranks(
        parallel_state.get_expert_model_parallel_group())
    local = experts // len(ep_ranks)
    node_experts = {}
    for d, rank in enumerate(ep_ranks):
        node_experts.setdefault(_node_of(rank), []).extend(range(d * local, (d + 1) * local))
    home, out = _node_of(torch.distributed.get_rank()), {}
    for node, held in node_experts.items():
        if node == home:
            continue
        hits = mine[:, held]
        each = int(hits.any(dim=1).sum()) * 2 * hidden * 4 + int(hits.sum()) * 4
        out[home] = out.get(home, 0) + each
        out[node] = out.get(node, 0) + each
    return out


def _bytes_report(per_rank):
    """per_rank: [{"kind/group/phase": sent}] -> {phase: {kind: [sent per rank]},
    "by_group": {phase: {"kind/group": [sent per rank]}}}."""
    world = len(per_rank)
    out = {phase: {kind: [0] * world for kind in KINDS} for phase in ("forward", "backward")}
    by_group = {"forward": {}, "backward": {}}
    for rank, rows in enumerate(per_rank):
        for key, sent in rows.items():
            kind, group, phase = key.split("/")
            out[phase][kind][rank] += sent
            by_group[phase].setdefault(f"{kind}/{group}", [0] * world)[rank] += sent
    out["by_group"] = by_group
    return out


def _median(values):
    return statistics.median(values) if values else None


def _dump_result(dump_dir, name, full_out, full_in_grad):
    """--dump: NAME_output.pt and NAME_input_grad.pt of data-parallel replica 0, as (T, M)."""
    if dump_dir and torch.distributed.get_rank() == 0:
        s, b, m = full_out.shape
        torch.save(full_out.reshape(s * b, m).cpu(), os.path.join(dump_dir, f"{name}_output.pt"))
        torch.save(full_in_grad.reshape(s * b, m).cpu(),
                   os.path.join(dump_dir, f"{name}_input_grad.pt"))


def _timed_step(layer, forward, x_local, g_local):
    """One forward + backward of forward(x) on a fresh copy of x_local with output grad
    g_local: (x, out, forward ms, backward ms)."""
    def step():
        for p in layer.parameters():
            p.grad = None
        x = x_local.detach().clone().requires_grad_()
        _sync()
        # every rank starts together: a rank's lead or lag from the step before (another
        # schedule's, when they interleave) is not charged to this one
        torch.distributed.barrier()
        t0 = time.perf_counter()
        out = forward(x)
        _sync()
        t1 = time.perf_counter()
        out.backward(g_local)
        _sync()
        t2 = time.perf_counter()
        return x, out, (t1 - t0) * 1e3, (t2 - t1) * 1e3
    return step


def run_schedule(name, args, replica, weights, device, dump_dir):
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from parm_trainer.models.config import transformer_config
    from parm_trainer.moe.comm import LEDGER

    config = transformer_config(args)
    layer = build_layer(args.moe_parm_schedule, config, args)
    shards = load_weights(layer, weights, args)
    layer.to(device)
    layer.train()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
    sp = args.sequence_parallel
    x_local = replica.local(replica.input, sp).to(args.params_dtype)
    g_local = replica.local(replica.output_grad, sp).to(args.params_dtype)

    step = _timed_step(layer, lambda x: layer(x)[0], x_local, g_local)

    # One iteration for correctness and bytes.
    _clear_tracker()
    LEDGER.reset()
    x, out, _, _ = step()
    bytes_local = _ledger_snapshot()
    received_local = _ledger_snapshot("received")
    aux = _tracked_aux(device)
    ref = replica.reference(_gate_calls(args.moe_parm_schedule, args))

    diffs, scale, rel = {}, {}, {}
    full_out = _gather_mp(out.detach(), sp).float()
    full_in_grad = _gather_mp(x.grad.detach(), sp).float()
    diffs["output"] = (full_out - ref["output"]).abs().max().item()
    diffs["input_grad"] = (full_in_grad - ref["input_grad"]).abs().max().item()
    scale["output"] = ref["output"].abs().max().item()
    scale["input_grad"] = ref["input_grad"].abs().max().item()
    rel["output"] = _rel_l2(full_out, ref["output"])
    rel["input_grad"] = _rel_l2(full_in_grad, ref["input_grad"])

    gate_grad = layer.router.weight.grad.detach().to(torch.float32, copy=True)
    if getattr(layer.router.weight, "sequence_parallel", False):
        torch.distributed.all_reduce(gate_grad,
                                     group=parallel_state.get_tensor_model_parallel_group())
    torch.distributed.all_reduce(gate_grad, group=parallel_state.get_data_parallel_group())
    diffs["gate_grad"] = (gate_grad - ref["gate_grad_total"]).abs().max().item()
    scale["gate_grad"] = ref["gate_grad_total"].abs().max().item()
    rel["gate_grad"] = _rel_l2(gate_grad, ref["gate_grad_total"])

    edp = parallel_state.get_expert_data_parallel_group()
    worst, biggest, rel["expert_grad"] = 0.0, 0.0, 0.0
    for expert, (e, rows) in zip(layer.experts.local_experts, shards):
        for param, want in ((expert.linear_fc1.weight, ref["fc1_grad_total"][e, rows, :]),
                            (expert.linear_fc2.weight, ref["fc2_grad_total"][e, :, rows])):
            grad = param.grad.detach().to(torch.float32, copy=True)
            torch.distributed.all_reduce(grad, group=edp)
            worst = max(worst, (grad - want).abs().max().item())
            biggest = max(biggest, want.abs().max().item())
            rel["expert_grad"] = max(rel["expert_grad"], _rel_l2(grad, want))
    diffs["expert_grad"], scale["expert_grad"] = worst, biggest

    if args.moe_aux_loss_coeff:
        if aux is None:
            diffs["aux_loss"] = float("inf")
        else:
            diffs["aux_loss"] = (aux - ref["aux_loss"]).abs().item()
        scale["aux_loss"] = ref["aux_loss"].abs().item()
    else:
        diffs["aux_loss"] = scale["aux_loss"] = None
    for key in DIFF_KEYS:
        if diffs[key] is not None:
            diffs[key] = _max_over_ranks(diffs[key])
    rel = {key: _max_over_ranks(value) for key, value in rel.items()}

    _dump_result(dump_dir, name, full_out, full_in_grad)
    del x, out

    both = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(both, (bytes_local, received_local))
    ledger, received = [sent for sent, _ in both], [got for _, got in both]
    cross = [0] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(
        cross, _cross_node_bytes(bytes_local, layer.groups) if hasattr(layer, "groups") else None)
    result = {
        "status": "ok",
        "plan": str(layer.plan) if hasattr(layer, "plan") else
                f"megatron-core MoELayer ({args.moe_token_dispatcher_type} dispatcher)",
        "chunks": args.moe_parm_chunks,
        "auto_choice": args.auto_choice,
        "forward_ms": None,
        "backward_ms": None,
        "total_ms": None,
        "bytes": None if args.moe_parm_schedule == "megatron" else _bytes_report(ledger),
        "bytes_received": None if args.moe_parm_schedule == "megatron" else
                          _bytes_report(received),
        # the busiest node's outgoing bytes (forward + backward) and their time on its link
        "cross_node_bytes": None if None in cross else _busiest_node(cross),
        "max_abs_diff": diffs,
        "reference_max_abs": scale,
        # |got - reference| / |reference| (L2 norms): the measure for --bf16, where a
        # token whose top-k ties differently in bf16 changes a max abs diff but not this
        "rel_l2_diff": rel,
        "aux_loss": None if aux is None else aux.item(),
    }
    return result, step


def _rel_l2(got, want) -> float:
    norm = want.norm().item()
    return (got - want).norm().item() / norm if norm else (got - want).norm().item()


def run_peer(name, args, replica, weights, device, dump_dir):
    """A DeepSpeed MoE layer (tools/deepspeed_peer.py) on the same weights and input, its
    output and input grad checked against the reference. Its objective leaves out the aux
    loss: DeepSpeed's top-2 aux loss is GShard's, not megatron-core's (a definition, not an
    error), so the reference is taken without it too; gate, expert and aux comparisons are
    left to Parm's rows. Its collectives are DeepSpeed's own, outside the byte ledger."""
    import deepspeed_peer

    layer = deepspeed_peer.build(args.peer, args, weights, device)
    sp = args.sequence_parallel
    x_local = replica.local(replica.input, sp)
    g_local = replica.local(replica.output_grad, sp)

    step = _timed_step(layer, lambda x: deepspeed_peer.forward(layer, x)[0], x_local, g_local)

    x, out, _, _ = step()
    ref = replica.reference(1, aux=False)  # DeepSpeed gates every MP rank's full token set
    full_out, full_in_grad = _gather_mp(out.detach(), sp), _gather_mp(x.grad.detach(), sp)
    diffs = {key: None for key in DIFF_KEYS}
    scale = dict(diffs)
    for key, got in (("output", full_out), ("input_grad", full_in_grad)):
        diffs[key] = _max_over_ranks((got - ref[key]).abs().max().item())
        scale[key] = ref[key].abs().max().item()
    _dump_result(dump_dir, name, full_out, full_in_grad)
    result = {"status": "ok", "plan": f"deepspeed.moe.layer.MoE ({args.peer})",
              "chunks": None, "auto_choice": None, "forward_ms": None, "backward_ms": None,
              "total_ms": None,
              "bytes": None, "cross_node_bytes": None, "max_abs_diff": diffs,
              "reference_max_abs": scale, "aux_loss": None}
    return result, step


def time_schedules(timed: dict, args) -> None:
    """Fill each result's forward_ms, backward_ms and total_ms (forward + backward of one
    iteration; its max over ranks is the row's time: ranks wait for each other in different
    phases, so the sum of the phases' maxima would count one wait twice). The schedules'
    iterations interleave (one iteration of each in turn), so a change of the machine's speed
    during the run touches every schedule alike instead of whichever ran at that moment, and
    the turn starts one schedule later each iteration, so no schedule always runs in the wake
    of the same one."""
    times = {name: [] for name in timed}  # (forward, backward) per iteration
    names = list(timed)
    for i in range(args.warmup + args.iters):
        turn = i % len(names)
        for name in names[turn:] + names[:turn]:
            _clear_tracker()
            *_, f, b = timed[name][1]()
            if i >= args.warmup:
                times[name].append((f, b))
    _clear_tracker()
    for name, (result, _) in timed.items():
        mine = [_median([t[k] for t in times[name]]) for k in range(2)]
        mine.append(_median([f + b for f, b in times[name]]))
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        for index, key in enumerate(("forward_ms", "backward_ms", "total_ms")):
            per_rank = [t[index] for t in gathered]
            result[key] = None if per_rank[0] is None else {
                "rank0": per_rank[0], "max": max(per_rank), "per_rank": per_rank}


def time_steps(timed: dict, args) -> None:
    """--step-times: each Parm row's plan steps through the level-2 step clock
    (parm_trainer/moe/step_timing.py) over --warmup + --iters more iterations. Per rank, the
    median of each step and of the steps' sums; result["step_ms"] keeps them with the
    forward + backward of the same iterations (max over ranks). A step runs inside its
    iteration's forward or backward, so the sums can never exceed those."""
    from parm_trainer.moe import step_timing

    for name, (result, step) in timed.items():
        if ":" not in result["plan"]:  # megatron's and DeepSpeed's layers have no plan steps
            continue
        step_timing.enable()
        rows = []
        for i in range(args.warmup + args.iters):
            _clear_tracker()
            *_, fwd, bwd = step()
            steps = {key.split("/", 2)[2]: ms * 1e3 for key, ms in step_timing.collect().items()}
            if i >= args.warmup:
                rows.append((steps, fwd, bwd))
        step_timing.enable(False)
        keys = sorted({key for steps, _, _ in rows for key in steps})
        mine = {"steps": {key: _median([steps.get(key, 0.0) for steps, _, _ in rows])
                          for key in keys},
                "fwd_steps": [sum(v for k, v in steps.items() if k.endswith("-fwd"))
                              for steps, _, _ in rows],
                "bwd_steps": [sum(v for k, v in steps.items() if k.endswith("-bwd"))
                              for steps, _, _ in rows],
                "fwd": [f for _, f, _ in rows], "bwd": [b for _, _, b in rows]}
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        result["step_ms"] = {
            "per_rank": gathered,
            "steps_max": {key: max(g["steps"].get(key, 0.0) for g in gathered) for key in keys},
            "steps_total": max(_median([f + b for f, b in zip(g["fwd_steps"], g["bwd_steps"])])
                               for g in gathered),
            "fwd_bwd_total": max(_median([f + b for f, b in zip(g["fwd"], g["bwd"])])
                                 for g in gathered)}


def format_step_times(run) -> str:
    """A line per Parm row timed with --step-times: each step's forward/backward (its waits
    in brackets), their sum against the row's fwd+bwd."""
    from parm_trainer.training.timers import format_steps

    lines = []
    for name, r in run["schedules"].items():
        timing = r.get("step_ms")
        if not timing:
            continue
        steps, _, _ = format_steps(timing["steps_max"])
        total = _total_ms(r)
        lines.append(f"{name} steps fwd/bwd ms: {steps}")
        lines.append(f"{name} steps sum {timing['steps_total']:.2f} ms = "
                     f"{timing['steps_total'] / timing['fwd_bwd_total']:.3f} x the fwd+bwd of the "
                     f"same iterations ({timing['fwd_bwd_total']:.2f} ms), "
                     f"{timing['steps_total'] / total:.3f} x the row's ({total:.2f} ms, untimed)")
    return "\n".join(lines)


def _config_summary(args):
    return {
        "world_size": args.world_size,
        "device": str(_device()),
        "backend": args.distributed_backend,
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "expert_model_parallel_size": args.expert_model_parallel_size,
        "expert_tensor_parallel_size": args.expert_tensor_parallel_size,
        "data_parallel_size": args.world_size // (args.tensor_model_parallel_size
                                                  * args.pipeline_model_parallel_size),
        "sequence_parallel": args.sequence_parallel,
        "num_experts": args.num_experts,
        "moe_router_topk": args.moe_router_topk,
        "moe_router_pre_softmax": args.moe_router_pre_softmax,
        "hidden_size": args.hidden_size,
        "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
        "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size,
        "tokens_per_mp_group": args.seq_length * args.micro_batch_size,
        "moe_expert_capacity_factor": args.moe_expert_capacity_factor,
        "moe_pad_expert_input_to_capacity": args.moe_pad_expert_input_to_capacity,
        "moe_token_drop_policy": args.moe_token_drop_policy,
        "moe_parm_chunks": args.moe_parm_chunks,
        "moe_parm_exchange": args.moe_parm_exchange,
        "ratio_to": args.ratio_to,
        "moe_aux_loss_coeff": args.moe_aux_loss_coeff,
        "moe_token_dispatcher_type": args.moe_token_dispatcher_type,
        "init_method_std": args.init_method_std,
        "seed": args.seed,
        "iters": args.iters,
        "warmup": args.warmup,
        "router": _router(args),
        "activation": ACTIVATION,
    }


def _router(args) -> str:
    return ROUTER_PRE_SOFTMAX if args.moe_router_pre_softmax else ROUTER


def _trial(args, name):
    """args for one entry of --schedules: megatron-alltoall / megatron-allgather are
    megatron-core's MoELayer with that token dispatcher; auto is the schedule (and, with
    --moe-parm-chunks 0, the pipeline depth) the cost model picks for this layer, from
    --moe-parm-cost-profile or the built-in profile."""
    from parm_trainer.moe.auto import resolve_auto_schedule

    trial = copy.copy(args)
    trial.peer = name.split("-", 1)[1] if name.startswith("deepspeed-") else None
    if trial.peer:
        return trial
    if name.startswith("megatron-"):
        trial.moe_parm_schedule = "megatron"
        trial.moe_token_dispatcher_type = name.split("-", 1)[1]
    else:
        trial.moe_parm_schedule = name
    said = []
    resolve_auto_schedule(trial, log=said.append)
    trial.auto_choice = said[0] if said else None
    return trial


def _tune_pending(runnable, results):
    """Trials auto left to be measured (no cost profile): measured now, on this layout, as a
    training run does at start-up (parm_trainer/moe/tune.py); one none of whose candidates can
    run is reported as skipped."""
    from parm_trainer.moe.tune import tune_at_startup
    from parm_trainer.parallel import LayoutError

    out = []
    for schedule, trial in runnable:
        if getattr(trial, "moe_parm_tune_candidates", None):
            said = []
            try:
                tune_at_startup(trial, log=said.append)
            except LayoutError as error:
                results[schedule] = {"status": "skipped", "reason": str(error)}
                continue
            trial.auto_choice = said[0]
        out.append((schedule, trial))
    return out


def run_config(args, name=None, dump_dir=None):
    """Every schedule of args on this world; returns {"name", "config", "schedules"}."""
    from parm_trainer.parallel import LayoutError, validate_layout

    runnable, results = [], {}
    for schedule in args.schedule_list:
        try:
            trial = _trial(args, schedule)
            if trial.peer:  # DeepSpeed checks its own layouts (deepspeed_peer.build)
                runnable.append((schedule, trial))
                continue
            validate_layout(trial)
        except (LayoutError, ValueError) as error:  # ValueError: auto found nothing to run
            results[schedule] = {"status": "skipped", "reason": str(error)}
            continue
        runnable.append((schedule, trial))
    device = _device()
    if runnable:
        set_layout(runnable[0][1])
        runnable = _tune_pending(runnable, results)
    if runnable:
        weights = full_weights(args)
        replica = Replica(runnable[0][1], weights, device)
        if dump_dir and torch.distributed.get_rank() == 0:
            os.makedirs(dump_dir, exist_ok=True)
            s, b, m = replica.input.shape
            torch.save(replica.input.reshape(s * b, m).cpu(), os.path.join(dump_dir, "input.pt"))
            torch.save(replica.output_grad.reshape(s * b, m).cpu(),
                       os.path.join(dump_dir, "output_grad.pt"))
            torch.save({**weights, "activation": ACTIVATION, "router": _router(args)},
                       os.path.join(dump_dir, "weights.pt"))
            dp = torch.distributed.get_world_size() // args.tensor_model_parallel_size
            for d in range(dp):  # every replica's input, for checks that need all ranks' tokens
                torch.save(replica_data(args, d)[0].reshape(s * b, m),
                           os.path.join(dump_dir, f"input_dp{d}.pt"))
        unique = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(unique, _unique_payload(runnable[0][1], replica))
        nodes = {}
        for per_node in unique:
            for node, nbytes in per_node.items():
                nodes[node] = nodes.get(node, 0) + nbytes
        unique_bytes = max(nodes.values(), default=0)
        timed = {}
        for schedule, trial in runnable:
            runner = run_peer if trial.peer else run_schedule
            try:
                timed[schedule] = runner(schedule, trial, replica, weights, device, dump_dir)
            except PeerCannotRun as error:  # raised on every rank alike, before any timing
                results[schedule] = {"status": "skipped", "reason": str(error)}
        time_schedules(timed, args)
        if args.step_times:
            time_steps(timed, args)
        results.update({schedule: result for schedule, (result, _) in timed.items()})
    else:
        unique_bytes = None
    ordered = {s: results[s] for s in args.schedule_list}
    base = ordered.get(args.ratio_to, {})
    base_total = _total_ms(base)
    for result in ordered.values():
        total = _total_ms(result)
        result["fwd_bwd_ratio"] = (total / base_total
                                               if total is not None and base_total else None)
        cross = result.get("cross_node_bytes")
        result["link_floor_ms"] = (cross / args.link_bytes_per_s * 1e3
                                   if cross and args.link_bytes_per_s else None)
    unique_ms = (unique_bytes / args.link_bytes_per_s * 1e3
                 if unique_bytes and args.link_bytes_per_s else None)
    return {"name": name, "config": _config_summary(args), "schedules": ordered,
            "unique_payload_bytes": unique_bytes, "unique_payload_floor_ms": unique_ms}


def _total_ms(result):
    if result.get("status") != "ok" or not result["total_ms"]:
        return None
    return result["total_ms"]["max"]


# --- report --------------------------------------------------------------------------------

def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def format_table(run) -> str:
    c = run["config"]
    unique_ms = run.get("unique_payload_floor_ms")
    head = (f"MoE layer: world {c['world_size']} ({c['device']}),"
            f" MP {c['tensor_model_parallel_size']} EP {c['expert_model_parallel_size']} ESP {c['expert_tensor_parallel_size']}"
            f" DP {c['data_parallel_size']}{' SP' if c['sequence_parallel'] else ''}; "
            f"E {c['num_experts']} top-{c['moe_router_topk']}"
            f"{' pre-softmax' if c.get('moe_router_pre_softmax') else ''} M {c['hidden_size']}"
            f" H {c['moe_ffn_hidden_size']} S {c['seq_length']} B {c['micro_batch_size']}"
            f" f {c['moe_expert_capacity_factor'] or 'dropless'} chunks {c['moe_parm_chunks']}")
    if run.get("name"):
        head = f"[{run['name']}] " + head
    cols = ("schedule", "fwd ms r0/max", "bwd ms r0/max", "fwd+bwd ms", "ratio", "a2a KiB", "ag KiB",
            "rs KiB", "ar KiB", "node KiB", "floor ms", "x floor", "x uniq", "d out", "d in-grad",
            "d gate", "d expert", "d aux")
    rows = []
    for name, r in run["schedules"].items():
        if r["status"] != "ok":
            rows.append((name, f"skipped: {r['reason']}"))
            continue
        f, b = r["forward_ms"], r["backward_ms"]
        kib = []
        for kind in KINDS:
            if r["bytes"] is None:
                kib.append("null")
            else:
                per_rank = [fw + bw for fw, bw in zip(r["bytes"]["forward"][kind],
                                                      r["bytes"]["backward"][kind])]
                kib.append(format(max(per_rank) / 1024, ".1f"))
        d = r["max_abs_diff"]
        if r.get("auto_choice"):  # what the cost model chose: auto=s1/r4, or s1/r4 (chunks 0)
            name = (f"{name}={r['plan'].split(':')[0]}" if name == "auto" else name) + \
                f"/r{r['chunks']}"
        rows.append((name,
                     f"{_fmt(f and f['rank0'], '.2f')}/{_fmt(f and f['max'], '.2f')}",
                     f"{_fmt(b and b['rank0'], '.2f')}/{_fmt(b and b['max'], '.2f')}",
                     _fmt(_total_ms(r), ".2f"), _fmt(r["fwd_bwd_ratio"], ".2f"), *kib,
                     _fmt(r["cross_node_bytes"] and r["cross_node_bytes"] / 1024, ".1f"),
                     _fmt(r["link_floor_ms"], ".1f"),
                     _fmt(r["link_floor_ms"] and _total_ms(r) / r["link_floor_ms"], ".2f"),
                     _fmt(unique_ms and _total_ms(r) / unique_ms, ".2f"),
                     *(_fmt(d[k], ".1e") for k in DIFF_KEYS)))
    widths = [max([len(cols[i])] + [len(row[i]) for row in rows
                                     if len(row) == len(cols) or i == 0])
              for i in range(len(cols))]
    lines = [head, "  ".join(col.ljust(w) for col, w in zip(cols, widths))]
    for row in rows:
        if len(row) == 2:
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
        else:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    lines.append("fwd+bwd ms: one iteration's forward + backward, max over ranks; bytes: sent per "
                 "rank (max over ranks), forward + backward, one iteration; "
                 f"ratio: fwd+bwd / {c['ratio_to']}'s; node KiB: sent off the "
                 "busiest node (forward + backward); floor ms: that over --inter-node-rate; "
                 "x floor: fwd+bwd / floor; x uniq: fwd+bwd / the unique-payload floor ("
                 f"{_fmt(run.get('unique_payload_bytes') and run['unique_payload_bytes'] / 1024, '.1f')}"
                 f" KiB leaving the busiest node, {_fmt(unique_ms, '.1f')} ms: each token once "
                 "per remote node of its experts, out and back, forward and backward); "
                 "d: max abs diff to reference.py")
    return "\n".join(lines)


def worker(args) -> int:
    from parm_trainer.compat import cpu

    cpu.apply()
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.configs:
        with open(args.configs) as fh:
            entries = json.load(fh)
        runs = []
        progress = Progress(len(entries), "bench_moe_layer configurations",
                            enabled=os.environ.get("RANK", "0") == "0")
        for i, entry in enumerate(entries):
            sub = parse(entry["argv"], world_size=args.world_size)
            name = entry.get("name", str(i))
            dump = os.path.join(args.dump, name) if args.dump else None
            runs.append(run_config(sub, name, dump))
            progress.done(name)
        payload = {"runs": runs}
    else:
        runs = [run_config(args, None, args.dump)]
        payload = runs[0]
    if not torch.distributed.is_initialized():  # every schedule of every config was skipped
        from parm_trainer.parallel import initialize_distributed

        initialize_distributed(args)
    if torch.distributed.get_rank() == 0:
        for run in runs:
            print(format_table(run), flush=True)
            steps = format_step_times(run)  # rows timed with --step-times
            if steps:
                print(steps, flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(payload, fh, indent=1)
    torch.distributed.barrier()  # rank 0 has written its files
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    under_torchrun = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        args = parse(argv, world_size=None)
    except ToolError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.nproc and not under_torchrun:
        if args.nproc < 1:
            print("error: --nproc must be at least 1", file=sys.stderr)
            return 2
        return launch(argv, args.nproc)
    _WORKER[0] = True
    return worker(args)


_WORKER = [False]

if __name__ == "__main__":
    status = main()
    if _WORKER[0]:
        # Every rank is past the final barrier and rank 0's files are written: leave without
        # the interpreter's teardown of megatron's many process groups (seconds on a CPU).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
