"""The MoE layer the cost model prices: its shape on one MP group, from the flags or by hand.

LayerShape holds what the price of a layer depends on (tokens, widths, experts and top-k, the
layout, the exchange and its depth, the relay, routing groups, a shared expert), with the
expected routing loads (ep_hit, node_hit: routing_odds.py) and the dropless capacity.
layer_shape(args) builds it for a job. docs/cost_model.md says how each field is priced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Optional

from parm_trainer import node_relay
from parm_trainer.moe.link_sharing import remote_share_of, tiled_groups
from parm_trainer.moe.routing_odds import hit


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer on one MP group. tokens N = micro-batch x seq entering the MP group."""
    tokens: int
    hidden: int
    ffn: int
    experts: int
    topk: int
    capacity_factor: Optional[float]  # None: dropless, balanced routing assumed
    bytes_per_element: int = 2
    mp: int = 1   # G; MP ranks are consecutive
    ep: int = 1   # EP ranks have stride ESP (megatron's expert order tp-ep-dp-pp)
    esp: int = 1  # ESP ranks are consecutive
    sequence_parallel: bool = False
    chunks: int = 1
    dp: int = 1   # MP groups in the pipeline stage (their gate calls share the dropless capacity)
    # What-if: round a capacity-factor capacity up to the multiple a plan that splits it needs,
    # as the executor does only when dropless (today it refuses such layouts instead).
    pad_capacity: bool = False
    # s1's and s2's exchange: exact (exchange.py; each token once per EP rank it needs, exact
    # counts) or padded (the (E, C, M) layout). The baseline is always padded.
    exact: bool = False
    gated: bool = False  # SwiGLU: fc1 is 2H wide, three H x M matrices per expert
    # R: EP ranks per node the exact exchange relays through (node_relay.py); 1: one hop
    relay: int = 1
    # --moe-parm-local-first: the exact exchange's own-EP-rank rows in two pieces of their own
    local_first: bool = False
    # group-limited routing (--moe-router-num-groups, --moe-router-group-topk; 0: none)
    groups: int = 0
    group_topk: int = 0
    # a shared expert of this FFN width (0: none), run before the gate or, overlapped, on the
    # main thread while the exchange's first piece travels (shared_expert.py)
    shared_ffn: int = 0
    shared_overlap: bool = False

    @property
    def matrices(self) -> int:
        return 3 if self.gated else 2

    def ep_hit(self) -> float:
        """The chance that a token's k distinct experts, drawn uniformly, include one of a
        given EP rank's E/EP: 1 - C(E - L, k) / C(E, k) (group-limited: routing_odds.py).
        Expected rows one rank sends to each EP rank in the exact exchange: tokens x
        ep_hit."""
        return self._hit(self.experts // self.ep)

    def expert_gemms(self) -> int:
        """GEMM calls of one expert pass on a rank: fc1 and fc2 of each local expert (megatron's
        SequentialMLP runs them one expert after the other; SwiGLU's fc1 is one 2H-wide call)."""
        return 2 * (self.experts // self.ep)

    def node_hit(self) -> float:
        """ep_hit for the R L experts of one node (relayed: rows per destination node)."""
        return self._hit(self.relay * (self.experts // self.ep))

    def _hit(self, held: int) -> float:
        """routing_odds.hit of a block of `held` experts, the mean over the blocks."""
        blocks = range(0, self.experts, held)
        return sum(hit(self.experts, self.topk, held, start, self.groups, self.group_topk)
                   for start in blocks) / len(blocks)

    def capacity(self, n: int, multiple: int = 1) -> int:
        """Slots per expert for one gate call on n tokens (rounded up to `multiple` when
        dropless, or with pad_capacity). Dropless, it is the largest expert load over every
        gate call of the stage (layer.py agrees it with a MAX all-reduce): under random
        routing each load is about Normal(n*p, n*p*(1-p)), p = k/E, and the expected largest
        of m = E * calls such loads is mean + sd * z(m), z(m) = Phi^-1((m - 0.375)/(m + 0.25))
        (Blom's approximation; z(1) = 0). calls = dp * N / n: a plan that gates 1/G of the
        tokens makes G times as many calls on smaller samples, so its maximum sits further
        above the mean (on 4 ranks, MP 4, 512 tokens, 4 experts, top-2: 74 slots predicted and
        measured for s1's calls on 128 tokens, 64 if balanced)."""
        if self.capacity_factor is not None:
            slots = math.ceil(n * self.topk / self.experts * self.capacity_factor)
            if not self.pad_capacity:
                return slots
        else:
            p = min(1.0, self.topk / self.experts)
            m = self.experts * self.dp * max(1, self.tokens // max(n, 1))
            z = NormalDist().inv_cdf((m - 0.375) / (m + 0.25))
            slots = min(n, math.ceil(n * p + z * math.sqrt(n * p * (1 - p)) - 1e-9))
        return math.ceil(slots / multiple) * multiple

    def group(self, name: str) -> tuple:
        """(size, rank stride) of group "mp", "ep" or "esp", or of the relay's hops "ep_link"
        (one EP rank per node) and "ep_node" (the R EP ranks of a node)."""
        return {"mp": (self.mp, 1), "esp": (self.esp, 1), "ep": (self.ep, self.esp),
                "ep_link": (self.ep // self.relay, self.esp * self.relay),
                "ep_node": (self.relay, self.esp)}[name]


def remote_share(size: int, stride: int, gpus_per_node: int) -> float:
    """The largest share of a member's peers that sit on other nodes, over the groups of
    `size` ranks at `stride` (groups tiling blocks of size*stride consecutive ranks): 0 when
    every group is inside a node, 1 when no two members share one."""
    if size < 2:
        return 0.0
    return remote_share_of(tiled_groups(size, stride, gpus_per_node), gpus_per_node)


def layer_shape(args, per_node=None) -> LayerShape:
    """The MoE layer of args' model on its layout; per_node: ranks per node (default: this
    job's, node_relay.ranks_per_node), which decides whether the exact exchange relays."""
    relay = node_relay.relay_size(args, per_node or node_relay.ranks_per_node(args))
    return LayerShape(
        tokens=args.seq_length * args.micro_batch_size, hidden=args.hidden_size,
        ffn=args.moe_ffn_hidden_size, experts=args.num_experts, topk=args.moe_router_topk,
        capacity_factor=args.moe_expert_capacity_factor, bytes_per_element=(
            2 if args.bf16 or getattr(args, "fp16", False) else 4),
        mp=args.tensor_model_parallel_size, ep=args.expert_model_parallel_size,
        esp=args.expert_tensor_parallel_size, sequence_parallel=args.sequence_parallel,
        chunks=args.moe_parm_chunks,
        exact=args.moe_parm_exchange != "padded", gated=bool(getattr(args, "swiglu", False)),
        relay=relay, local_first=bool(getattr(args, "moe_parm_local_first", False)),
        shared_ffn=getattr(args, "moe_shared_expert_intermediate_size", None) or 0,
        shared_overlap=bool(getattr(args, "moe_shared_expert_overlap", False)),
        groups=getattr(args, "moe_router_num_groups", None) or 0,
        group_topk=getattr(args, "moe_router_group_topk", None) or 0,
        dp=args.world_size // (args.tensor_model_parallel_size
                               * args.pipeline_model_parallel_size))
