"""Alpha-beta cost model of a MoE layer: prices a Plan (schedules.py) step by step, from the
same plan objects the executor (layer.py) runs, with the byte formulas of comm.py.

    from parm_trainer.moe.cost_model import LayerShape, DEFAULT_PROFILE, choose_schedule
    choose_schedule(LayerShape(tokens=8192, hidden=2048, ffn=8192, experts=16, topk=2,
                               capacity_factor=1.0, mp=8, ep=4, esp=8), DEFAULT_PROFILE)

Walking a plan. The model tracks what this rank holds between steps, as the executor does:
tokens (n, M), n = N, or N/G under sequence parallelism or after split_tokens; or a dispatched
(E, c, M) tensor, c = C after dispatch, C/G after split_capacity.
C is the capacity of ONE gate call on n tokens: ceil(n*k*f/E) (megatron's get_capacity); when
f is None (dropless), the expected largest expert load over the stage's gate calls under random
routing (LayerShape.capacity), rounded up to a multiple of G where the plan splits the capacity
(as layer.py rounds the agreed maximum load).

Collectives, for the bytes THIS rank sends in a group of W ranks (comm.py's ledger), B the
bytes of the tensor the collective takes:
    alltoall B*(W-1)/W; allgather B*(W-1) (B = the local piece); reducescatter B*(W-1)/W;
    allreduce 2*B*(W-1)/W;   cost = alpha + sent * beta,
alpha and beta per kind and per link class: "intra" when every group of that kind sits inside
one node, "inter" otherwise; then a ring collective's bytes all pay the inter-node rate (the
ring runs at its slowest hop), an AlltoAll's only the share sent to peers on other nodes
(Profile.price). A group of one is the identity and costs nothing. Backward of each step is
its dual (comm.py):
    a2a -> a2a, allreduce -> nothing, split_* -> AllGather of the piece, gather_tokens ->
    nothing, copy -> AllReduce, gate[mp] (split tokens) -> AllReduce of the router weight's
    gradient (E*M) over MP; its forward all-reduces the E per-expert token counts (int64) over
    MP for the aux loss, unless the exact exchange's count AllGather carries them (EP x ESP a
    multiple of MP: megatron-core nests the groups).

Pipeline step (s1's and s2's expert exchange, in r = min(chunks, c) pieces): AlltoAll, ESP
AllGather, expert, ESP ReduceScatter, AlltoAll back (and s2's MP gather) per piece of the
capacity slots, priced by replaying the executor's schedule on per-piece prices (pipeline_s):
the outbound AlltoAlls run back to back on the EP group, the main thread takes each piece as it
arrives (gather + expert + scatter), its return AlltoAll queues behind the outbound ones, then
its MP gather. Backward: the same with the returns' grads first (the AllGather's dual is a
ReduceScatter and back), the expert's work doubled and no MP traffic (each MP rank keeps its
block of the replicated grad). r = 1 is the sum of it all, each collective after the other.
Local first (exact exchange, one hop, EP > 1): the pieces carry (EP - 1) / EP of the rows and
this rank's own 1 / EP runs as two halves on the main thread, one before piece 0 arrives and
one after the last return is issued, each paying its ESP gather and scatter.

Compute: flops priced calls * alpha + flops*beta, one alpha per GEMM call (the expert step
makes 2 per local expert, fc1 and fc2; the pipeline step that many per piece, so a deeper
pipeline pays more of them); the backward costs twice the forward.
    expert: 2 * rows * M * (H/ESP) * 2 (fc1 and fc2; * 3 with SwiGLU's gated fc1, 2H wide),
            rows = E*c slots, E*c*ESP in the
            exchange after its ESP gather (padding included: the executor runs the expert on
            every slot);   gate: 2 * n * M * E.
Memory-bound work, when the profile has a "memory" entry (alpha s, beta s/byte of bytes read
plus written; calibrate_comm measures it): dispatch and combine move (n + E*c) * M elements
(read the tokens, write the slots, or back), the expert's activation reads and writes its
rows * H/ESP hidden elements; backward again twice the forward. Without the entry it is not
priced (on GPUs it is small next to the GEMMs and the links; on CPUs it is not).
Whole layer (optional "layer" entry, fitted by tools/validate_cost_model.py on measured layers
and cross-validated there, each half of its grid predicted by terms fitted on the other): a
step's collectives cost comm_factor times their isolated alpha-beta time and its compute and
memory work compute_factor times theirs (interference: on a shared machine they slow each other
down; 1 when absent), and every step adds host_s_per_step (framework and launch cost; backward
twice), and every collective call (the pipeline step makes one per collective and piece) adds
s_per_call (outside any overlap, but in the pipeline step on the main thread's time of its
piece, pipeline_s): each call is a point where ranks wait for the slowest of them, and host
work of its own, which an isolated calibration of the call does not see;
calibrate_comm measures it on its own (3 MP collectives in each node's group after stretches
of 2-30 ms of compute, beyond the two apart: bench/calibrate.measure_sync_wait) and the
whole-model planner adds it to every collective call of the dense pieces too but P2P, whose
wait the pipeline steps price. (Fitted
as the latency of each piece's collectives instead, it could not tell r = 2 from r = 4 on 8
processes per 2 cores, where more pieces measured up to 50 % slower; on the main thread those
cores-bound pieces pay it in full, docs/cost_model.md.)
Exact exchange (LayerShape.exact, exchange.py): no capacity; a rank sends each EP rank the
expected tokens x ep_hit() rows of M + L values (L = E/EP routing weights) and gets one row of
M back for each; see _exact_step_load. Relayed (LayerShape.relay = R > 1, node_relay.py): each
node gets tokens x node_hit() rows of M + R L over the link ("ep_link", one EP rank per node),
and the in-node AlltoAlls ("ep_node") forward the same rows per EP rank as the one hop would
send, priced on the main thread beside the ESP gather and scatter. Not priced: the one-scalar
all-reduce that agrees the padded exchange's dropless capacity; expert loads are taken at their
means (the slowest rank's excess over the mean is not priced).

Over 500 lines on purpose: this docstring is the model's specification, and the loads
(step_load), their prices and the plan walk that it describes read as one with it, beside the
Profile and LayerShape they price with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Optional

import numpy as np

from parm_trainer.moe.link_sharing import (concurrency_factor, link_flows, remote_share_of,
                                           sharing, tiled_groups)
from parm_trainer.moe.plan import Plan, Step
from parm_trainer.moe.routing_odds import hit
from parm_trainer.moe.schedules import build_plan

KINDS = ("alltoall", "allgather", "reducescatter", "allreduce")
LAYER_KEYS = ("comm_factor", "compute_factor", "host_s_per_step", "s_per_call")
LAYER_DEFAULT = (1.0, 1.0, 0.0, 0.0)
LINKS = ("intra", "inter")


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


class ProfileError(ValueError):
    """A cost profile that cannot be used; the message names the file and the bad entry."""


@dataclass
class Profile:
    """alpha (s) and beta (s/byte) per collective kind and link class; GEMM alpha (s) and
    beta (s/FLOP); GPUs per node (placing groups intra- or inter-node); for a calibrated
    profile, the world size it was measured on."""
    gpus_per_node: int
    collectives: dict  # {kind: {"intra": (alpha, beta), "inter": (alpha, beta)}}
    compute: tuple     # (alpha, beta)
    name: str = "custom"
    description: str = ""
    world_size: Optional[int] = None
    memory: Optional[tuple] = None  # (alpha, beta) per byte moved; None: not priced
    # Whole-layer terms fitted on measured layers (tools/validate_cost_model.py): factors on
    # the collectives' and on the compute's isolated times (interference when they share a
    # machine), a host cost per plan step (seconds, forward; backward twice) and a cost per
    # collective call (seconds; ranks waiting for each other at each blocking call).
    layer: tuple = (1.0, 1.0, 0.0, 0.0)
    # Collectives one process group runs at once: NCCL 1 (its stream runs them in order),
    # gloo 2 (two worker threads per group), so two started AlltoAlls share the link and land
    # together. The pipeline's arrivals (pipeline_s) depend on it.
    lanes: int = 1
    # Shared links and cores (link_sharing.py): a node's links (flows at full rate; None: one
    # per rank, nothing shared), the flows per node link the "inter" rates were measured with,
    # and ((ranks computing at once, compute time factor), ...) relative to the calibration's
    # all-at-once rate (empty: no sharing).
    node_links: Optional[float] = None
    inter_flows: int = 1
    compute_concurrency: tuple = ()
    # Bytes a node's link passes at once after it has idled (a traffic shaper's bucket; 0 on
    # a link that never runs above its rate): calibrate_comm measures it with sends after a
    # pause; the planner's P2P transfers between stages, spaced by a stage's compute, get it.
    burst_bytes: float = 0.0

    def price(self, kind: str, shape: LayerShape, group: str) -> tuple:
        """(alpha s, beta s per byte sent) of collective `kind` on the layer's `group`. An
        AlltoAll across nodes sends only the blocks of its remote peers over the network,
        while the others stay in the node at the (far faster) intra-node rate: the inter beta
        (per byte that crosses, as calibrate_comm fits it) is scaled by the remote share of
        the peers. A ring collective runs at its slowest hop, so all its bytes pay the
        inter-node rate."""
        return self.rate(kind, *shape.group(group))

    def rate(self, kind: str, size: int, stride: int = 1, groups: list = None) -> tuple:
        """price() for any group of `size` ranks at `stride` (consecutive groups tiling the
        ranks, all running at once), or for the explicit `groups` running at once. A ring
        collective across nodes pays the link sharing of its flows (link_sharing.py) over the
        calibration's."""
        groups = groups or tiled_groups(size, stride, self.gpus_per_node)
        share = remote_share_of(groups, self.gpus_per_node)
        alpha, beta = self.collectives[kind]["inter" if share > 0 else "intra"]
        if share == 0:
            return alpha, beta
        if kind == "alltoall":
            return alpha, beta * share
        links = self.node_links or self.gpus_per_node
        flows = link_flows(groups, self.gpus_per_node)
        return alpha, beta * sharing(flows, links) / sharing(self.inter_flows, links)

    def concurrency(self, ranks: float) -> float:
        """The compute time factor with `ranks` ranks computing at once (1: as calibrated)."""
        return concurrency_factor(self.compute_concurrency, ranks)

    def scaled_compute(self, factor: float) -> "Profile":
        """This profile with compute and memory work (alpha and beta: on shared cores the
        host's part slows down too) `factor` times as long, and the wait at a collective call
        (layer s_per_call) too: it is time spent on a peer still computing, measured with
        every rank computing (calibrate_comm), so it stretches and shrinks with the rate."""
        if factor == 1.0:
            return self
        memory = None if self.memory is None else tuple(v * factor for v in self.memory)
        layer = (*self.layer[:3], self.layer[3] * factor)
        return replace(self, compute=tuple(v * factor for v in self.compute), memory=memory,
                       layer=layer)

    def to_json(self, path: Optional[str] = None) -> str:
        """Exact alpha/beta in seconds; written to `path` too when given."""
        data = {"name": self.name, "description": self.description,
                "gpus_per_node": self.gpus_per_node,
                "collectives": {k: {link: {"alpha": a, "beta": b} for link, (a, b) in v.items()}
                                for k, v in self.collectives.items()},
                "compute": {"alpha": self.compute[0], "beta": self.compute[1]}}
        if self.memory is not None:
            data["memory"] = {"alpha": self.memory[0], "beta": self.memory[1]}
        if tuple(self.layer) != LAYER_DEFAULT:
            data["layer"] = dict(zip(LAYER_KEYS, self.layer))
        if self.world_size is not None:
            data["world_size"] = self.world_size
        if self.lanes != 1:
            data["lanes"] = self.lanes
        if self.node_links is not None:
            data["node_links"] = self.node_links
        if self.inter_flows != 1:
            data["inter_flows"] = self.inter_flows
        if self.compute_concurrency:
            data["compute_concurrency"] = [list(p) for p in self.compute_concurrency]
        if self.burst_bytes:
            data["burst_bytes"] = self.burst_bytes
        text = json.dumps(data, indent=2)
        if path:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, source: str) -> "Profile":
        """From JSON text or a file path. Each (alpha, beta) entry is either {"alpha": s,
        "beta": s/byte} or, for hand-written cluster files, {"alpha_us": us, "GBps": GB/s}
        (compute: {"alpha_us", "TFLOPs"}; memory: {"alpha_us", "GBps"}). Top-level keys:
        gpus_per_node, collectives, compute (required); memory, layer (some of
        "comm_factor", "compute_factor", "host_s_per_step", "s_per_call"), lanes, node_links,
        inter_flows, compute_concurrency ([[ranks, factor], ...]), burst_bytes, name,
        description, world_size, notes, fit (optional). Anything else, a
        missing entry, or a negative, zero-rate or non-finite number raises ProfileError."""
        where = "cost profile"
        if not source.lstrip().startswith("{"):
            where = f"cost profile {source}"
            try:
                with open(source) as f:
                    source = f.read()
            except OSError as error:
                raise ProfileError(f"{where}: cannot read ({error.strerror})") from None
        try:
            data = json.loads(source)
        except json.JSONDecodeError as error:
            raise ProfileError(f"{where}: not valid JSON ({error})") from None
        return _profile_from_dict(data, where)


_TOP_KEYS = {"gpus_per_node", "collectives", "compute", "memory", "layer", "lanes", "name",
             "description", "world_size", "notes", "fit", "node_links", "inter_flows",
             "compute_concurrency", "burst_bytes"}


def _profile_from_dict(data, where: str) -> Profile:
    def bad(what):
        return ProfileError(f"{where}: {what}")

    if not isinstance(data, dict):
        raise bad("expected a JSON object")
    unknown = sorted(set(data) - _TOP_KEYS)
    missing = sorted({"gpus_per_node", "collectives", "compute"} - set(data))
    if unknown or missing:
        raise bad(f"unknown keys {unknown}" if unknown else f"missing keys {missing}")
    gpus = data["gpus_per_node"]
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise bad(f"gpus_per_node must be a positive integer, got {gpus!r}")
    lanes = data.get("lanes", 1)
    if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes < 1:
        raise bad(f"lanes must be a positive integer, got {lanes!r}")
    world = data.get("world_size")
    if world is not None and (not isinstance(world, int) or isinstance(world, bool) or world < 1):
        raise bad(f"world_size must be a positive integer, got {world!r}")
    colls = data["collectives"]
    if not isinstance(colls, dict) or sorted(colls) != sorted(KINDS):
        raise bad(f"collectives must have exactly the kinds {list(KINDS)}, got "
                  f"{sorted(colls) if isinstance(colls, dict) else colls!r}")
    collectives = {}
    for kind in KINDS:
        links = colls[kind]
        if not isinstance(links, dict) or sorted(links) != sorted(LINKS):
            raise bad(f"collectives.{kind} must have exactly {list(LINKS)}")
        collectives[kind] = {link: _pair(links[link], "GBps", 1e9, f"{where}: collectives."
                                         f"{kind}.{link}") for link in LINKS}
    layer = data.get("layer", {})
    if not isinstance(layer, dict) or not set(layer) <= set(LAYER_KEYS):
        raise bad(f"layer must have some of {list(LAYER_KEYS)}, got {layer!r}")
    try:
        layer = tuple(float(layer.get(k, d)) for k, d in zip(LAYER_KEYS, LAYER_DEFAULT))
    except (TypeError, ValueError):
        raise bad(f"layer values must be numbers, got {data['layer']!r}") from None
    if not all(math.isfinite(v) for v in layer) or min(layer[:2]) <= 0 or min(layer[2:]) < 0:
        raise bad(f"layer factors must be > 0 and host_s_per_step, s_per_call >= 0, got "
                  f"{data['layer']!r}")
    links, flows, concurrency = _sharing_entries(data, bad)
    burst = data.get("burst_bytes", 0.0)
    if (isinstance(burst, bool) or not isinstance(burst, (int, float))
            or not math.isfinite(burst) or burst < 0):
        raise bad(f"burst_bytes must be a number >= 0, got {burst!r}")
    return Profile(gpus_per_node=gpus, collectives=collectives, layer=layer, lanes=lanes,
                   node_links=links, inter_flows=flows, compute_concurrency=concurrency,
                   burst_bytes=float(burst),
                   compute=_pair(data["compute"], "TFLOPs", 1e12, f"{where}: compute"),
                   memory=(_pair(data["memory"], "GBps", 1e9, f"{where}: memory")
                           if "memory" in data else None),
                   name=str(data.get("name", "custom")),
                   description=str(data.get("description", "")), world_size=world)


def _sharing_entries(data, bad) -> tuple:
    """(node_links, inter_flows, compute_concurrency) of a profile's JSON, checked."""
    links = data.get("node_links")
    if links is not None and (isinstance(links, bool) or not isinstance(links, (int, float))
                              or not math.isfinite(links) or links < 1):
        raise bad(f"node_links must be a number >= 1, got {links!r}")
    flows = data.get("inter_flows", 1)
    if not isinstance(flows, int) or isinstance(flows, bool) or flows < 1:
        raise bad(f"inter_flows must be a positive integer, got {flows!r}")
    points = data.get("compute_concurrency", [])
    try:
        points = tuple((int(r), float(f)) for r, f in points)
    except (TypeError, ValueError):
        raise bad(f"compute_concurrency must be [[ranks, factor], ...], got {points!r}") from None
    if any(r < 1 or not (math.isfinite(f) and f > 0) for r, f in points):
        raise bad(f"compute_concurrency needs ranks >= 1 and factors > 0, got {points!r}")
    return (None if links is None else float(links)), flows, points


def _pair(entry, rate_key: str, unit: float, where: str) -> tuple:
    """(alpha s, beta s/unit) from {"alpha", "beta"} or {"alpha_us", rate_key}."""
    forms = ({"alpha", "beta"}, {"alpha_us", rate_key})
    if not isinstance(entry, dict) or set(entry) not in forms:
        raise ProfileError(f"{where}: expected {{'alpha', 'beta'}} or {{'alpha_us', "
                           f"'{rate_key}'}}, got {entry!r}")
    try:
        values = {k: float(v) for k, v in entry.items()}
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: values must be numbers, got {entry!r}") from None
    if not all(math.isfinite(v) for v in values.values()):
        raise ProfileError(f"{where}: values must be finite, got {entry!r}")
    if "beta" in values:
        alpha, beta = values["alpha"], values["beta"]
    else:
        if values[rate_key] <= 0:
            raise ProfileError(f"{where}: {rate_key} must be positive, got {entry!r}")
        alpha, beta = values["alpha_us"] * 1e-6, 1.0 / (values[rate_key] * unit)
    if alpha < 0 or beta <= 0:
        raise ProfileError(f"{where}: alpha must be >= 0 and beta > 0, got {entry!r}")
    return alpha, beta


def _rates(ring: dict, alltoall: dict) -> dict:
    """{link: (alpha_us, GB/s)} for the ring collectives and for AlltoAll -> collectives."""
    def pair(alpha_us, gbps):
        return (alpha_us * 1e-6, 1.0 / (gbps * 1e9))
    return {k: {link: pair(*(alltoall if k == "alltoall" else ring)[link]) for link in LINKS}
            for k in KINDS}


# A default, not a measurement (the numbers of tools/clusters/a100-nvlink-8x.json): an A100
# node, NVLink ~150 GB/s per GPU and ~10 us for ring collectives, AlltoAll ~130 GB/s and 15 us;
# one 200 Gb/s InfiniBand NIC per GPU, 25 GB/s raw, ~22 GB/s taken by ring collectives (30 us),
# ~19 GB/s by AlltoAll (40 us); bf16 GEMMs at ~150 TFLOP/s effective, 10 us launch. Calibrate a
# profile on the real cluster and pass it with --moe-parm-cost-profile.
DEFAULT_PROFILE = Profile(
    gpus_per_node=8,
    collectives=_rates(ring={"intra": (10, 150.0), "inter": (30, 22.0)},
                       alltoall={"intra": (15, 130.0), "inter": (40, 19.0)}),
    compute=(10e-6, 1.0 / 150e12), name="default-a100",
    description="assumed: A100 NVLink node, one 200 Gb/s IB NIC per GPU")


@dataclass(frozen=True)
class Held:
    """What this rank holds when a step starts: n tokens, or (E, capacity, M) when capacity."""
    tokens: int
    capacity: int = 0
    multiple: int = 1  # dropless capacity is rounded up to this (G where the plan splits it)


@dataclass(frozen=True)
class StepLoad:
    """One step's work on this rank: collectives ((kind, group, bytes sent), ...) per phase,
    GEMM flops and memory traffic; the pipeline step's collectives are one () or
    ((kind, group, bytes),) per stage, run in `chunks` pieces."""
    forward: tuple = ()
    backward: tuple = ()
    chunks: int = 1
    flops: float = 0.0  # forward; the backward is priced at twice the forward
    moved: float = 0.0  # bytes read + written by memory-bound work, forward (backward twice)
    pipeline: bool = False  # the "pipeline" step: collectives (out, ag, rs, back[, gather])
    gemms: int = 1  # GEMM calls in the forward (per piece in the pipeline), each paying alpha
    local_share: float = 0.0  # of the exchange's rows, computed in the two local halves


def sent_bytes(kind: str, nbytes: int, world: int) -> int:
    """Bytes this rank sends, as comm.py's ledger records them."""
    if world == 1:
        return 0
    if kind == "allgather":
        return nbytes * (world - 1)
    return (2 if kind == "allreduce" else 1) * nbytes * (world - 1) // world


def step_load(step: Step, shape: LayerShape, held: Held) -> tuple:
    """(StepLoad, Held after the step). Raises ValueError where the executor would."""
    s, op, b = shape, step.op, shape.bytes_per_element
    n, c = held.tokens, held.capacity
    slab = s.experts * c * s.hidden * b  # bytes of the dispatched (E, c, M) held

    def coll(kind, group, nbytes):
        world = s.group(group)[0]
        return ((kind, group, sent_bytes(kind, nbytes, world)),) if world > 1 else ()

    def need(ok, what):
        if not ok:
            raise ValueError(f"{step}: {what}")

    if op in ("split_tokens", "gather_tokens"):
        part = n // s.mp if op == "split_tokens" else n
        need(op == "gather_tokens" or n % s.mp == 0, f"{n} tokens do not split over MP {s.mp}")
        ag = coll("allgather", "mp", part * s.hidden * b)
        load = StepLoad(backward=ag) if op == "split_tokens" else StepLoad(forward=ag)
        return load, replace(held, tokens=part if op == "split_tokens" else n * s.mp)
    if s.exact and op in ("dispatch", "split_capacity", "pipeline", "combine"):
        return _exact_step_load(step, s, held, coll, need)
    if op == "split_capacity":
        need(c % s.mp == 0, f"capacity {c} does not split over MP {s.mp}")
        ag = coll("allgather", "mp", s.experts * (c // s.mp) * s.hidden * b)
        return StepLoad(backward=ag), replace(held, capacity=c // s.mp)
    if op == "gate":
        if step.group != "mp":
            return StepLoad(flops=2 * n * s.hidden * s.experts), held
        # on split tokens: the router's per-expert token counts (int64) summed over MP for the
        # load-balancing loss (the exact exchange's count AllGather carries them where its
        # EP x ESP group holds the MP group: aux_loss.py), and in backward the router weight's
        # gradient (under sequence parallelism summed once per iteration with the layer norms'
        # instead, layer.py)
        carried = s.exact and (s.ep * s.esp) % s.mp == 0
        counts = () if carried else coll("allreduce", "mp", s.experts * 8)
        wgrad = () if s.sequence_parallel else coll("allreduce", "mp", s.experts * s.hidden * b)
        return StepLoad(forward=counts, backward=wgrad, flops=2 * n * s.hidden * s.experts), held
    if op == "dispatch":
        c = s.capacity(n, held.multiple)
        return (StepLoad(moved=(n + s.experts * c) * s.hidden * b),
                replace(held, capacity=c))
    if op == "combine":
        return StepLoad(moved=(n + s.experts * c) * s.hidden * b), replace(held, capacity=0)
    if op == "a2a":
        need(s.experts % s.ep == 0, f"{s.experts} experts do not split over EP {s.ep}")
        a2a = coll("alltoall", "ep", slab)
        return StepLoad(forward=a2a, backward=a2a), held
    if op in ("copy", "allreduce"):
        ar = coll("allreduce", "esp", slab)
        return (StepLoad(backward=ar) if op == "copy" else StepLoad(forward=ar)), held
    if op == "expert":
        need(s.ffn % s.esp == 0, f"ffn {s.ffn} does not split over ESP {s.esp}")
        rows, h = s.experts * c, s.ffn // s.esp
        return StepLoad(flops=2 * rows * s.hidden * h * s.matrices, moved=2 * rows * h * b,
                        gemms=s.expert_gemms()), held
    if op == "pipeline":  # a2a, ESP gather, expert, ESP scatter, a2a back [, MP gather]
        need(s.experts % s.ep == 0, f"{s.experts} experts do not split over EP {s.ep}")
        need(s.ffn % s.esp == 0, f"ffn {s.ffn} does not split over ESP {s.esp}")
        a2a, ag = coll("alltoall", "ep", slab), coll("allgather", "esp", slab)
        rs = coll("reducescatter", "esp", slab * s.esp)
        gather = coll("allgather", "mp", slab) if "mp" in step.group.split(",") else ()
        # the expert runs on the slots gathered over ESP; backward, the gather and the scatter
        # swap (their duals move the same bytes) and the MP gather's dual sends nothing
        expert, _ = step_load(Step("expert"), shape, replace(held, capacity=c * s.esp))
        load = StepLoad(forward=(a2a, ag, rs, a2a, gather), backward=(a2a, rs, ag, a2a, ()),
                        pipeline=True, chunks=max(1, min(s.chunks, c)),
                        flops=expert.flops, moved=expert.moved, gemms=expert.gemms)
        return load, replace(held, capacity=c * s.mp if gather else c)
    raise ValueError(f"unknown plan step {step}")


def _exact_step_load(step: Step, s: LayerShape, held: Held, coll, need) -> tuple:
    """The exact exchange's steps (exchange.py): dispatch only marks the kept pairs, and
    agrees the send counts with one AllGather of small ints over the EP x ESP group, made as
    an AlltoAll to every rank (comm_uneven.gather_counts; priced on EP, whose links it
    crosses); s2's split keeps 1/G of the tokens and their E weights
    (backward: their AllGather); the pipeline sends rows = tokens x ep_hit to each EP rank,
    M + L wide, and gets one row of M back for each; the expert runs on the rows' k / EP
    expected (token, expert) pairs per row sent, gathered over ESP; the combine adds the
    returned rows into the tokens."""
    op, b, n = step.op, s.bytes_per_element, held.tokens
    local, pieces = s.experts // s.ep, max(1, min(s.chunks, n))
    if op == "dispatch":
        per_piece = s.ep + (s.ep // s.relay if s.relay > 1 else 0)  # relayed: per node too
        counts = coll("alltoall", "ep", (2 + pieces * per_piece) * 8)
        return StepLoad(forward=counts, moved=n * s.experts * 4), held
    if op == "split_capacity":
        need(n % s.mp == 0, f"{n} tokens do not split over MP {s.mp}")
        part = n // s.mp
        return (StepLoad(backward=coll("allgather", "mp", part * (s.hidden + s.experts) * b)),
                replace(held, tokens=part))
    rows = n * s.ep_hit()  # per EP destination; a rank receives as many from each sender
    if op == "combine":
        return StepLoad(moved=(n + rows * s.ep) * s.hidden * b), held
    need(s.experts % s.ep == 0, f"{s.experts} experts do not split over EP {s.ep}")
    need(s.ffn % s.esp == 0, f"ffn {s.ffn} does not split over ESP {s.esp}")
    received = rows * s.ep  # rows this rank holds after the outbound AlltoAll (or both hops)
    wide, narrow = (s.hidden + local) * b, s.hidden * b
    if s.relay > 1:  # over the link once per node, R L weights wide; forwarded in the node
        nodes, linked = s.ep // s.relay, n * s.node_hit() * (s.ep // s.relay)
        link_wide = (s.hidden + s.relay * local) * b
        out, back = (coll("alltoall", "ep_link", linked * link_wide),
                     coll("alltoall", "ep_link", linked * narrow))
        hop, hop_back = (coll("alltoall", "ep_node", received * wide),
                         coll("alltoall", "ep_node", received * narrow))
        need(nodes * s.relay == s.ep, f"EP {s.ep} is not {s.relay} ranks on each node")
    else:
        out, back = coll("alltoall", "ep", received * wide), coll("alltoall", "ep",
                                                                   received * narrow)
        hop = hop_back = ()
    ag, rs = coll("allgather", "esp", received * wide), \
        coll("reducescatter", "esp", s.esp * received * narrow)
    ag_dual, rs_dual = coll("allgather", "esp", received * narrow), \
        coll("reducescatter", "esp", s.esp * received * wide)
    gather = coll("allgather", "mp", n * narrow) if "mp" in step.group.split(",") else ()
    pairs, h = s.esp * n * s.topk, s.ffn // s.esp  # expert rows after the ESP gather
    # the in-node hops run on the main thread, with the ESP gather and scatter
    local_first = s.local_first and s.relay == 1 and s.ep > 1  # a rank's own rows: 1 / EP
    load = StepLoad(forward=(out, hop + ag, rs + hop_back, back, gather),
                    backward=(back, hop_back + ag_dual, rs_dual + hop, out, ()),
                    pipeline=True, chunks=pieces, gemms=s.expert_gemms(),
                    flops=2 * pairs * s.hidden * h * s.matrices, moved=2 * pairs * h * b,
                    local_share=1 / s.ep if local_first else 0.0)
    return load, replace(held, tokens=n * s.mp if gather else n)


def pipeline_s(out: tuple, main: float, back: tuple, tail: tuple, chunks: int,
               lanes: int = 1, local: tuple = (0.0, 0.0)) -> float:
    """Seconds of one phase of the "pipeline" step over r = chunks pieces. out, back, tail:
    (alpha, transfer seconds of ONE chunk) of its AlltoAll, its AlltoAll back and s2's MP
    gather ((0, 0) for s1); main: seconds the main thread spends on one chunk (gather, expert,
    scatter). As the executor runs it: every outbound AlltoAll is issued at once, so they
    stream back to back on the EP group and only the first pays its latency, `lanes` at a
    time sharing the link (Profile.lanes: gloo runs two, which land together); the main
    thread takes chunk i once it has arrived and issues its AlltoAll back, which follows the
    outbound ones and earlier returns on the same group (paying its latency only if the
    group was idle); each return is then gathered over MP. r = 1 is the sum of all of it; as
    r grows the time tends to the longer of the link's transfers and the main thread's work.
    local: the main thread's seconds on the two local halves (--moe-parm-local-first), the
    first before chunk 0 arrives, the second after the last return is issued; the gathers
    over MP then start after it."""
    link, main_free, tail_free, arrived, returned = 0.0, local[0], 0.0, [], []
    for first in range(0, chunks, lanes):
        batch = min(lanes, chunks - first)
        link = max(out[0] + batch * out[1], link + batch * out[1])
        arrived += [link] * batch
    for i in range(chunks):
        main_free = max(main_free, arrived[i]) + main
        link = max(main_free + back[0] + back[1], link + back[1])
        returned.append(link)
    main_free += local[1]
    for done in returned:
        start = max(done, main_free) if local[1] else done
        tail_free = max(start + tail[0] + tail[1], tail_free + tail[1])
    return max(link, main_free, tail_free if tail != (0.0, 0.0) else 0.0)


def _phase_s(colls: tuple, shape: LayerShape, profile: Profile) -> float:
    """Isolated seconds of a phase's collectives, one after the other."""
    seconds = 0.0
    for kind, group, sent in colls:
        alpha, beta = profile.price(kind, shape, group)
        seconds += alpha + sent * beta
    return seconds


def _work_s(flops: float, moved: float, profile: Profile, gemms: int = 1) -> float:
    """Compute and memory seconds of flops in `gemms` GEMM calls and bytes moved (the
    isolated prices)."""
    seconds = gemms * profile.compute[0] + flops * profile.compute[1] if flops else 0.0
    if moved and profile.memory is not None:
        seconds += profile.memory[0] + moved * profile.memory[1]
    return seconds


def shared_expert_s(shape: LayerShape, profile: Profile) -> tuple:
    """(forward_s, backward_s) of the shared expert: an MLP of width shape.shared_ffn over the
    MP group's tokens, its two GEMMs split over MP, with its MP collectives (under sequence
    parallelism an AllGather of its input and a ReduceScatter of its output, else an
    AllReduce of the output; the backward mirrors them) and the backward's two GEMMs each."""
    if not shape.shared_ffn:
        return 0.0, 0.0
    comm_factor, compute_factor, _, per_call = profile.layer
    n, m, b = shape.tokens, shape.hidden, shape.bytes_per_element
    flops = 2 * n * m * shape.shared_ffn * shape.matrices / shape.mp
    work = _work_s(flops, 0.0, profile, gemms=2) * compute_factor
    kinds = ("allgather", "reducescatter") if shape.sequence_parallel else ("allreduce",)
    colls = tuple((kind, "mp", sent_bytes(kind, n * m * b // (shape.mp if kind == "allgather"
                                                              else 1), shape.mp))
                  for kind in kinds)
    comm = (_phase_s(colls, shape, profile) * comm_factor + per_call * len(colls)
            if shape.mp > 1 else 0.0)
    return work + comm, 2 * work + comm


def _pipeline_cost(load: StepLoad, shape: LayerShape, profile: Profile) -> tuple:
    """(forward_s, backward_s) of the pipeline step: pipeline_s on per-chunk prices, with the
    layer terms (collectives x comm_factor, work x compute_factor), plus host_s_per_step, and
    s_per_call for each of its calls, r per collective, on the main thread's time of the piece
    it belongs to: a call's wait for the slowest rank and its host work take the main thread
    (and, where the cores bound the layer, add up piece by piece), while a link still carrying
    earlier pieces hides them as it hides the piece's compute."""
    comm_factor, compute_factor, host, per_call = profile.layer
    r = load.chunks

    def chunk(colls):  # (alpha, transfer) of one chunk's share of its collectives
        alpha = transfer = 0.0
        for kind, group, sent in colls:
            a, beta = profile.price(kind, shape, group)
            alpha, transfer = alpha + a * comm_factor, transfer + sent / r * beta * comm_factor
        return alpha, transfer

    work = _work_s(load.flops / r, load.moved / r, profile, load.gemms) * compute_factor
    share = load.local_share
    # the overlapped shared expert: the main thread's work while the first piece travels out
    shared = shared_expert_s(shape, profile)[0] if shape.shared_overlap else 0.0
    phases = []
    for colls, weight in ((load.forward, 1), (load.backward, 2)):
        out, ag, rs, back, tail = (chunk(c) for c in colls)
        piece_calls, half_calls = _pipeline_calls(colls)
        # per piece: the calls' latency and waits, then the rows' transfers and work
        fixed, rows = ag[0] + rs[0], ag[1] + rs[1] + weight * work
        # local first: each chunk keeps the other EP ranks' share of the rows, and each half
        # of this rank's own rows pays one more gather and scatter
        half = fixed + per_call * half_calls + share * r * rows / 2 if share else 0.0
        first = half + (shared if weight == 1 else 0.0)
        phases.append(pipeline_s(out, fixed + per_call * piece_calls + (1 - share) * rows,
                                 back, tail, r, profile.lanes, (first, half)) + weight * host)
    return tuple(phases)


def step_cost(step: Step, shape: LayerShape, profile: Profile, held: Held) -> tuple:
    """(forward_s, backward_s) of one step, entered holding `held` (see walk)."""
    load, _ = step_load(step, shape, held)
    if load.pipeline:
        return _pipeline_cost(load, shape, profile)
    compute = _work_s(load.flops, load.moved, profile, load.gemms)
    comm_factor, compute_factor, host, per_call = profile.layer
    compute = compute * compute_factor + host
    return tuple(_phase_s(colls, shape, profile) * comm_factor + per_call * calls(colls, load)
                 + compute * weight
                 for colls, weight in ((load.forward, 1), (load.backward, 2)))


def _pipeline_calls(colls: tuple) -> tuple:
    """(calls of one piece, calls of one local half) in a phase of the pipeline step: a piece
    makes one of each of its collectives (AlltoAlls, ESP gather and scatter, MP gather), a
    local half (--moe-parm-local-first) its ESP gather and scatter."""
    return sum(len(c) for c in colls), len(colls[1]) + len(colls[2])


def calls(colls: tuple, load: StepLoad) -> int:
    """Collective calls of one phase of a step: the pipeline step makes one of each of its
    collectives per piece, and with local first its two halves their ESP calls."""
    if load.pipeline:
        piece, half = _pipeline_calls(colls)
        return piece * load.chunks + (2 * half if load.local_share else 0)
    return len(colls)


def walk(plan: Plan, shape: LayerShape) -> list:
    """[(step, Held on entering it)] for the plan; shape.sequence_parallel must be the one the
    plan was built with. Raises ValueError for a layout the executor refuses."""
    if any(st.group == "esp" and st.op in ("copy", "allreduce") for st in plan.steps):
        if shape.esp != shape.mp:  # parallel.validate_layout: ESP ranks need the same tokens
            raise ValueError(f"{plan.name} reduces expert outputs over ESP: needs ESP {shape.esp}"
                             f" = MP {shape.mp}")
    n = shape.tokens // shape.mp if shape.sequence_parallel else shape.tokens
    held, out = Held(n, 0, shape.mp if plan.splits_capacity else 1), []
    for step in plan.steps:
        out.append((step, held))
        held = step_load(step, shape, held)[1]
    return out


def plan_cost(plan: Plan, shape: LayerShape, profile: Profile) -> dict:
    """Per-step breakdown and totals (seconds), plus bytes sent keyed like
    comm.LEDGER.totals(phase=...): "kind/group" (the ledger does not see megatron's router
    count all-reduce of gate[mp], which the model prices)."""
    steps, total_f, total_b = [], 0.0, 0.0
    sent = {"forward": {}, "backward": {}}
    exchange = any(step.op == "pipeline" for step in plan.steps)
    if shape.shared_ffn:  # its forward in the exchange step where overlapped there
        fwd, bwd = shared_expert_s(shape, profile)
        overlapped = shape.shared_overlap and exchange
        total_f, total_b = (0.0 if overlapped else fwd), bwd
        steps.append({"step": "shared expert" + (" (overlapped)" if overlapped else ""),
                      "forward_s": 0.0 if overlapped else fwd, "backward_s": bwd,
                      "flops": 0, "forward_bytes": {}, "backward_bytes": {}})
    for step, held in walk(plan, shape):
        load, _ = step_load(step, shape, held)
        fwd, bwd = step_cost(step, shape, profile, held)
        total_f, total_b = total_f + fwd, total_b + bwd
        row = {"step": str(step), "forward_s": fwd, "backward_s": bwd, "flops": load.flops}
        for phase, colls in (("forward", load.forward), ("backward", load.backward)):
            if load.pipeline:  # (coll, ...) per stage, each () or ((kind, group, bytes),)
                colls = [c for stage in colls for c in stage]
            row[f"{phase}_bytes"] = {}
            for k, g, nbytes in colls:
                row[f"{phase}_bytes"][f"{k}/{g}"] = row[f"{phase}_bytes"].get(f"{k}/{g}", 0) + nbytes
            for key, nbytes in row[f"{phase}_bytes"].items():
                sent[phase][key] = sent[phase].get(key, 0) + nbytes
        steps.append(row)
    return {"plan": plan.name, "steps": steps, "forward_s": total_f, "backward_s": total_b,
            "total_s": total_f + total_b, "bytes": sent}


def shape_plan(name: str, shape: LayerShape) -> Plan:
    """The plan the executor runs for this shape (its sequence parallelism; the pieces of its
    exchange are shape.chunks)."""
    return build_plan(name, shape.sequence_parallel)


def price_schedules(shape: LayerShape, profile: Profile, names) -> dict:
    """{schedule: predicted forward + backward seconds, or None where the layout cannot run it}."""
    totals = {}
    for name in names:
        try:
            totals[name] = plan_cost(shape_plan(name, shape), shape,
                                     profile)["total_s"]
        except ValueError:
            totals[name] = None
    return totals


def choose_schedule(shape: LayerShape, profile: Profile, candidates=("s1", "s2")) -> tuple:
    """(cheapest candidate by forward + backward, {candidate: predicted seconds}); a candidate
    the layout cannot run is priced inf. Raises ValueError when none can run."""
    totals = {name: math.inf if seconds is None else seconds
              for name, seconds in price_schedules(shape, profile, candidates).items()}
    best = min(totals, key=totals.get)
    if math.isinf(totals[best]):
        raise ValueError(f"no schedule among {candidates} can run {shape}")
    return best, totals


def fit_alpha_beta(sizes_bytes, seconds) -> tuple:
    """Least squares seconds = alpha + beta * bytes: (alpha, beta, r^2)."""
    x, y = np.asarray(sizes_bytes, dtype=float), np.asarray(seconds, dtype=float)
    design = np.stack([np.ones_like(x), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = float(np.sum((y - design @ np.array([alpha, beta])) ** 2))
    spread = float(np.sum((y - y.mean()) ** 2))
    return float(alpha), float(beta), 1.0 - residual / spread if spread else 1.0
