"""ParmMoELayer: megatron-core's router and expert modules, run through a Parm schedule.

megatron-core's MoELayer fixes where the gate sits relative to the MP split; Parm moves it, so
this layer owns the whole forward and executes a Plan (schedules.py) step by step.

The exchange (dispatch, s2's MP split, the exchange itself, combine) is an object the layer
builds once and the executor calls: exact by default (exchange.ExactExchange: each token
crosses to each EP rank once, in AlltoAlls of exact counts, relayed through a node where an EP
group has several ranks on each of its nodes, node_relay.py; "direct" keeps one hop), or
padded (padded_exchange.PaddedExchange, --moe-parm-exchange padded, and always the baseline's:
the fixed (E, C, M) layout of PARM.md, C the capacity of one gate call, capacity()).

Recomputation (--recompute-granularity selective --recompute-modules moe, or
--moe-layer-recompute): the layer keeps what its exchange received and recomputes only local
work in the backward, the local experts on those rows (local()) and the shared expert, so the
recompute costs GEMMs and no exchange (docs/exchange.md, "Recomputation").
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_capacity, router_gating_linear
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import build_module

from parm_trainer import node_relay
from parm_trainer.moe import comm, shared_expert, step_timing
from parm_trainer.moe.aux_loss import DeferringRouter
from parm_trainer.moe.exchange import ExactExchange
from parm_trainer.moe.forced_routing import ForcedLogits
from parm_trainer.moe.grouped_experts import applies, grouped_experts
from parm_trainer.moe.padded_exchange import PaddedExchange
from parm_trainer.moe.plan import Op
from parm_trainer.moe.schedules import build_plan
from parm_trainer.moe_flags import router_dtype
from parm_trainer.parallel import consecutive_subgroup

EXCHANGES = ("exact", "direct", "padded")


def _stage_group():
    """All ranks of this pipeline stage: the dropless capacity is agreed over them."""
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    return consecutive_subgroup(torch.distributed.get_world_size() // stages)


def expert_comm_explicit(module: torch.nn.Module) -> int:
    """Give every expert linear whose tensor-parallel group is one rank explicit_expert_comm.

    megatron-core sets it on expert linears only where ESP > 1 or EP > 1. Otherwise the
    row-parallel fc2 "reduces" over its one-rank group, which returns its input through a
    custom autograd Function (a view to autograd), and the expert MLP then adds its bias to it
    in place (mlp.py, `output += output_bias ...`): "RuntimeError: Output 0 of
    _ReduceFromModelParallelRegion is a view and is being modified inplace" on any run with
    expert biases and EP = ESP = 1. On a one-rank group the collectives it skips are
    identities, so the flag changes nothing else. Returns the number of linears changed."""
    changed = 0
    for sub in module.modules():
        group = getattr(sub, "tp_group", None)
        if getattr(sub, "is_expert", False) and getattr(sub, "explicit_expert_comm", True) is \
                False and group is not None and group.size() == 1:
            sub.explicit_expert_comm = True
            changed += 1
    return changed


def mlp_recompute_to_parm(module: torch.nn.Module) -> int:
    """Leave --recompute-modules mlp to the dense MLPs, as megatron-core means it.

    megatron's TransformerLayer checkpoints its mlp whole under "mlp" unless the mlp is its own
    MoELayer; Parm's layer is not one, so it would be recomputed whole, its exchange repeated in
    the backward. Parm's layer recomputes its own local work under "moe" instead. Returns the
    layers changed."""
    changed = 0
    for sub in module.modules():
        if isinstance(getattr(sub, "mlp", None), ParmMoELayer) and getattr(sub, "recompute_mlp",
                                                                           False):
            sub.recompute_mlp = False
            changed += 1
    return changed


class ParmMoELayer(MegatronModule):
    def __init__(self, config, submodules=None, layer_number: Optional[int] = None,
                 pg_collection=None, schedule: str = "s1", chunks: int = 1,
                 exchange: str = "exact", local_first: bool = False,
                 shared_overlap: bool = False):
        super().__init__(config=config)
        self.layer_number = layer_number
        if schedule == "auto" or chunks < 1:
            raise ValueError(f"ParmMoELayer needs a resolved schedule and depth (got {schedule!r},"
                             f" chunks {chunks}): parm_trainer.training.initialize resolves "
                             "--moe-parm-schedule auto and --moe-parm-chunks 0 at start-up")
        self.plan = build_plan(schedule, config.sequence_parallel)
        self.step_labels = step_timing.labels(step.op for step in self.plan.steps)
        self.chunks = chunks
        self.local_first = local_first  # exchange.py: this EP rank's own rows computed first
        if exchange not in EXCHANGES:
            raise ValueError(f"--moe-parm-exchange {exchange!r}: choose one of {EXCHANGES}")
        self.exact = exchange != "padded" and schedule != "baseline"  # DeepSpeed's TED pads
        self.groups = {"mp": parallel_state.get_tensor_model_parallel_group(),
                       "ep": parallel_state.get_expert_model_parallel_group(),
                       "esp": parallel_state.get_expert_tensor_parallel_group()}
        # "exact" relays through a node where an EP group has several ranks on each of its nodes
        self.relay = node_relay.current() if self.exact and exchange == "exact" else None
        if self.relay is not None:  # the two hops' groups, by the names the ledger gives them
            self.groups.update(ep_link=self.relay.inter, ep_node=self.relay.intra)
        self.mp_size = comm.group_size(self.groups["mp"])
        self.ep_size = comm.group_size(self.groups["ep"])
        self.num_experts = config.num_moe_experts
        self.num_local_experts = self.num_experts // self.ep_size
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        router = DeferringRouter if submodules.router is TopKRouter else submodules.router
        self.router = router(config=config, pg_collection=pg_collection)
        self.router.set_layer_number(layer_number)
        # Router statistics (aux loss, z-loss) are summed over the ranks that split the tokens;
        # where every MP rank holds all tokens there is nothing to sum.
        self.router.tp_cp_group = (self.groups["mp"] if self.plan.splits_tokens
                                   else consecutive_subgroup(1))
        # ...and the exact exchange's count AllGather sums the aux loss's counts (aux_loss.py)
        self.aux_rows = self._mp_in_exchange_group() if self.plan.splits_tokens else None
        if isinstance(self.router, DeferringRouter):
            self.router.defer = self.aux_rows is not None
        # Gate gradients where the gate runs on split tokens (s1) are partial sums over MP.
        # Under sequence parallelism the weight is marked sequence-parallel, as megatron's own
        # router is, and finalize_model_grads sums it over TP once per iteration, coalesced with
        # the layer norms'; without it copy_to sums it in every backward. Elsewhere every MP
        # rank already holds the whole gradient.
        self.router.weight.sequence_parallel = (self.plan.splits_tokens
                                                and bool(config.sequence_parallel))
        # Global aux loss: counts summed over the ranks holding distinct tokens (DP, and MP
        # where the gate splits them; megatron's layer always splits them over MP)
        if not self.plan.splits_tokens and self.mp_size > 1:
            self.router.tp_dp_cp_group = parallel_state.get_data_parallel_group(
                with_context_parallel=True)
        self.experts = build_module(submodules.experts, self.num_local_experts, config,
                                    pg_collection=pg_collection)
        expert_comm_explicit(self.experts)  # wherever the layer is built (tune.py's too)
        # megatron's SharedExpertMLP, built with its own TP collectives (never the split API
        # megatron's dispatcher drives): Parm places the whole call, before the plan or, with
        # shared_overlap, while the exchange's first pieces are on the wire (shared_expert.py)
        self.shared_experts = shared_expert.build(config, submodules, pg_collection)
        self.shared_overlap = shared_overlap and self.shared_experts is not None
        self.force_balance = (ForcedLogits(layer_number)
                              if config.moe_router_force_load_balancing else None)
        # the exchange's dispatch, MP split, exchange and combine (exact or direct, or padded)
        self.exchange = ExactExchange(self) if self.exact else PaddedExchange(self)
        # selective recompute: "moe" recomputes the local experts (local()) and the shared
        # expert; "shared_experts" the shared expert alone (megatron-core's meaning)
        modules = (config.recompute_modules or () if config.recompute_granularity == "selective"
                   else ())
        self.recompute_experts = "moe" in modules
        self.recompute_shared = "moe" in modules or "shared_experts" in modules

    def _mp_in_exchange_group(self):
        """The MP ranks' positions in the exact exchange's count AllGather (over EP x ESP),
        where that group holds them all and MP > 1; else None."""
        if not self.exact or self.mp_size == 1:
            return None
        members = torch.distributed.get_process_group_ranks(
            parallel_state.get_expert_tensor_and_model_parallel_group())
        mp = torch.distributed.get_process_group_ranks(self.groups["mp"])
        if not set(mp) <= set(members):
            return None
        return [members.index(rank) for rank in mp]

    def set_layer_number(self, layer_number: int):
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)
        if self.force_balance is not None:
            self.force_balance.layer_number = layer_number

    # --- steps -------------------------------------------------------------------------------
    def _gate(self, tokens, seq_shape, split: bool):
        """megatron's TopKRouter.forward on these tokens (routing() holds the score function,
        expert bias, group-limited top-k, scaling and the aux losses), the gate weight copied
        into the MP group where the tokens are split."""
        router = self.router
        router._maintain_float32_expert_bias()
        weight = router.weight
        if split and not weight.sequence_parallel:  # else finalize_model_grads sums it
            weight = comm.copy_to(weight, self.groups["mp"], "mp")
        dtype = router_dtype(self.config.moe_router_dtype, tokens.dtype)
        logits = router_gating_linear(tokens, weight, router.bias, dtype)
        if self.force_balance is not None:  # --moe-router-force-load-balancing
            logits = self.force_balance(logits)
        return router.routing(logits.view(*seq_shape, self.num_experts))

    def capacity(self, routing_map) -> int:
        """Slots per expert of one gate call: from the capacity factor, or, dropless, the
        largest expert load in the pipeline stage (one MAX all-reduce)."""
        n = routing_map.shape[0]
        if self.config.moe_expert_capacity_factor is not None:
            return get_capacity(n * self.config.moe_router_topk, self.num_experts,
                                self.config.moe_expert_capacity_factor)
        load = routing_map.sum(dim=0).max().reshape(1).to(torch.int64)
        torch.distributed.all_reduce(load, op=torch.distributed.ReduceOp.MAX, group=_stage_group())
        capacity = max(1, int(load.item()))
        if self.plan.splits_capacity:  # round up so the capacity slots split evenly over MP
            capacity = math.ceil(capacity / self.mp_size) * self.mp_size
        return capacity

    def slots(self, routing_map) -> tuple:
        """(capacity C, each (token, expert) pair's position in its expert's queue, the pairs
        kept: those within C), for one gate call."""
        capacity = self.capacity(routing_map)
        position = torch.cumsum(routing_map.to(torch.int64), dim=0) - 1
        return capacity, position, routing_map & (position < capacity)

    def local(self, function, *tensors):
        """function(*tensors): local work on what the exchange received. Under "moe"
        recompute only the tensors are kept and function runs again in the backward
        (megatron-core's tensor_parallel.checkpoint, RNG states replayed)."""
        if self.recompute_experts and torch.is_grad_enabled():
            return tensor_parallel.checkpoint(function, False, *tensors)
        return function(*tensors)

    def _shared_call(self, hidden_states):
        if self.recompute_shared and torch.is_grad_enabled():
            return tensor_parallel.checkpoint(self.shared_experts, False, hidden_states)
        return self.shared_experts(hidden_states)

    def expert(self, x):
        """x: (E, c, M), dim 0 = EP blocks of this rank's local experts -> same shape, partial
        sums over ESP (the expert's row-parallel fc2 leaves the reduction to the schedule)."""
        return self.local(self._expert, x)

    def _expert(self, x):
        ep, local, (c, hidden) = self.ep_size, self.num_local_experts, x.shape[1:]
        grouped = x.view(ep, local, c, hidden).transpose(0, 1).reshape(-1, hidden)
        out = self.run_experts(grouped, [ep * c] * local,
                               torch.ones(grouped.shape[0], dtype=x.dtype, device=x.device))
        return out.view(local, ep, c, hidden).transpose(0, 1).reshape(ep * local, c, hidden)

    def run_experts(self, rows, counts: list, probs):
        """The local experts on rows (T, M) grouped by expert (counts: the rows of each, on the
        host), each output scaled by its row's probability: on CPU as two grouped GEMMs
        (grouped_experts.py), elsewhere by the experts module itself."""
        if rows.shape[0] and applies(self.experts, self.config, rows):
            return grouped_experts(self.experts, rows, counts, probs)
        out, _ = self.experts(rows, torch.tensor(counts, dtype=torch.int64), probs)
        return out

    # --- executor ----------------------------------------------------------------------------
    def forward(self, hidden_states, *args, **kwargs):
        seq, batch, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)
        groups = self.groups
        seq_shape, routing = (seq, batch), None
        clock = (step_timing.layer_clock(self.layer_number, self.step_labels)
                 if self.training and torch.is_grad_enabled() else None)
        shared_out = shared_expert.Deferred(
            self._shared_call if self.shared_experts is not None else None, hidden_states,
            self.shared_overlap)
        for step in self.plan.steps:
            op = step.op
            if clock is not None:  # --timing-log-level 2
                x = clock.enter(x)
            if op == Op.SPLIT_TOKENS:
                x = comm.split(x, groups["mp"], "mp", dim=0)
                seq_shape = (x.shape[0] // batch, batch)
            elif op == Op.GATHER_TOKENS:
                x = comm.gather(x, groups["mp"], "mp", dim=0)
                seq_shape = (x.shape[0] // batch, batch)
            elif op == Op.GATE:
                probs, routing_map = self._gate(x, seq_shape, split=step.group == "mp")
            elif op == Op.DISPATCH:
                x, routing = self.exchange.dispatch(x, probs, routing_map)
            elif op == Op.SPLIT_CAPACITY:
                x = self.exchange.split_capacity(x)
            elif op == Op.A2A:
                x = comm.all_to_all(x, groups["ep"], "ep")
            elif op == Op.COPY:
                x = comm.copy_to(x, groups["esp"], "esp")
            elif op == Op.ALLREDUCE:
                x = comm.all_reduce(x, groups["esp"], "esp")
            elif op == Op.EXPERT:
                x = self.expert(x)
            elif op == Op.EXCHANGE:
                x = self.exchange.run(x, "mp" in step.group.split(","), shared_out)
            elif op == Op.COMBINE:
                x = self.exchange.combine(x, routing)
            else:
                raise ValueError(f"unknown plan step {step}")
        if clock is not None:
            x = clock.leave(x)
        return shared_out.add_to(x.view(-1, batch, hidden)), None
