"""A cluster as the cost model sees it: calibrated rates per collective and link, GEMM and memory
rates, and the whole-layer terms (Profile), read from and written to JSON; the built-in default
(assumed A100 figures, not a measurement); --moe-parm-cost-profile loaded and checked against a
job. tools/calibrate_comm.py measures one (bench/calibration/); docs/cost_model.md describes
every entry.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from parm_trainer.errors import ProfileError
from parm_trainer.moe.cost_shape import LayerShape
from parm_trainer.moe.link_sharing import (concurrency_factor, link_flows, remote_share_of,
                                           sharing, tiled_groups)

KINDS = ("alltoall", "allgather", "reducescatter", "allreduce")
LAYER_KEYS = ("comm_factor", "compute_factor", "host_s_per_step", "s_per_call")
LAYER_DEFAULT = (1.0, 1.0, 0.0, 0.0)
LINKS = ("intra", "inter")

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
    # together. The exchange's arrivals (exchange_s) depend on it.
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


def fit_alpha_beta(sizes_bytes, seconds) -> tuple:
    """Least squares seconds = alpha + beta * bytes: (alpha, beta, r^2)."""
    x, y = np.asarray(sizes_bytes, dtype=float), np.asarray(seconds, dtype=float)
    design = np.stack([np.ones_like(x), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = float(np.sum((y - design @ np.array([alpha, beta])) ** 2))
    spread = float(np.sum((y - y.mean()) ** 2))
    return float(alpha), float(beta), 1.0 - residual / spread if spread else 1.0


def load_profile(args) -> Profile:
    """--moe-parm-cost-profile, checked against this job (ProfileError), or the default."""
    path = args.moe_parm_cost_profile
    if not path:
        return DEFAULT_PROFILE
    if not os.path.isfile(path):
        raise ProfileError(f"--moe-parm-cost-profile {path}: no such file")
    profile = Profile.from_json(path)
    if profile.world_size is not None and profile.world_size != args.world_size:
        raise ProfileError(f"--moe-parm-cost-profile {path} was measured on {profile.world_size}"
                           f" ranks, this job has {args.world_size}: calibrate on this layout "
                           "(tools/calibrate_comm.py)")
    return profile


def profile_source(args, profile: Profile) -> str:
    """How the log names the profile a prediction used (and, with no profile given, the
    measured layer times that priced the pieces: schedule/layer_times.py)."""
    given = args.moe_parm_cost_profile
    base = given or f"the built-in default profile ({profile.description})"
    times = getattr(args, "layer_times", None)
    return f"{times['source']}, communication from {base}" if times and not given else base
