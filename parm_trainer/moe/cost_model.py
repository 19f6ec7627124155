"""The MoE cost model: one layer's forward + backward time under each schedule on a Profile.

It walks the same Plan objects the executor (layer.py) runs: each step's collectives (the bytes
comm.LEDGER records), GEMMs and memory work on one rank (step_load), priced with the profile's
alpha-beta rates (step_cost); the expert exchange in r pieces is replayed as the executor
schedules it (exchange_s). price_schedules and choose_schedule compare schedules for a
LayerShape. What each price is made of, how a profile is calibrated, and how far the model
is to be trusted (measured): docs/cost_model.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from parm_trainer.moe.cost_profile import Profile
from parm_trainer.moe.cost_shape import LayerShape
from parm_trainer.moe.plan import Op, Plan, Step
from parm_trainer.moe.schedules import build_plan

CHUNK_CHOICES = (1, 2, 4, 8)  # the exchange depths auto weighs (--moe-parm-chunks 0)


@dataclass(frozen=True)
class Held:
    """What this rank holds when a step starts: n tokens, or (E, capacity, M) when capacity."""
    tokens: int
    capacity: int = 0
    multiple: int = 1  # dropless capacity is rounded up to this (G where the plan splits it)


@dataclass(frozen=True)
class StepLoad:
    """One step's work on this rank: collectives ((kind, group, bytes sent), ...) per phase,
    GEMM flops and memory traffic; the exchange step's collectives are one () or
    ((kind, group, bytes),) per stage, run in `chunks` pieces."""
    forward: tuple = ()
    backward: tuple = ()
    chunks: int = 1
    flops: float = 0.0  # forward; the backward is priced at twice the forward
    moved: float = 0.0  # bytes read + written by memory-bound work, forward (backward twice)
    exchange: bool = False  # the "exchange" step: collectives (out, ag, rs, back[, gather])
    gemms: int = 1  # GEMM calls in the forward (per piece in the exchange), each paying alpha
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
        part = n // s.mp if op == Op.SPLIT_TOKENS else n
        need(op == Op.GATHER_TOKENS or n % s.mp == 0, f"{n} tokens do not split over MP {s.mp}")
        ag = coll("allgather", "mp", part * s.hidden * b)
        load = StepLoad(backward=ag) if op == Op.SPLIT_TOKENS else StepLoad(forward=ag)
        return load, replace(held, tokens=part if op == Op.SPLIT_TOKENS else n * s.mp)
    if s.exact and op in (Op.DISPATCH, Op.SPLIT_CAPACITY, Op.EXCHANGE, Op.COMBINE):
        return _exact_step_load(step, s, held, coll, need)
    if op == Op.SPLIT_CAPACITY:
        need(c % s.mp == 0, f"capacity {c} does not split over MP {s.mp}")
        ag = coll("allgather", "mp", s.experts * (c // s.mp) * s.hidden * b)
        return StepLoad(backward=ag), replace(held, capacity=c // s.mp)
    if op == Op.GATE:
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
    if op == Op.DISPATCH:
        c = s.capacity(n, held.multiple)
        return (StepLoad(moved=(n + s.experts * c) * s.hidden * b),
                replace(held, capacity=c))
    if op == Op.COMBINE:
        return StepLoad(moved=(n + s.experts * c) * s.hidden * b), replace(held, capacity=0)
    if op == Op.A2A:
        need(s.experts % s.ep == 0, f"{s.experts} experts do not split over EP {s.ep}")
        a2a = coll("alltoall", "ep", slab)
        return StepLoad(forward=a2a, backward=a2a), held
    if op in ("copy", "allreduce"):
        ar = coll("allreduce", "esp", slab)
        return (StepLoad(backward=ar) if op == Op.COPY else StepLoad(forward=ar)), held
    if op == Op.EXPERT:
        need(s.ffn % s.esp == 0, f"ffn {s.ffn} does not split over ESP {s.esp}")
        rows, h = s.experts * c, s.ffn // s.esp
        return StepLoad(flops=2 * rows * s.hidden * h * s.matrices, moved=2 * rows * h * b,
                        gemms=s.expert_gemms()), held
    if op == Op.EXCHANGE:  # a2a, ESP gather, expert, ESP scatter, a2a back [, MP gather]
        need(s.experts % s.ep == 0, f"{s.experts} experts do not split over EP {s.ep}")
        need(s.ffn % s.esp == 0, f"ffn {s.ffn} does not split over ESP {s.esp}")
        a2a, ag = coll("alltoall", "ep", slab), coll("allgather", "esp", slab)
        rs = coll("reducescatter", "esp", slab * s.esp)
        gather = coll("allgather", "mp", slab) if "mp" in step.group.split(",") else ()
        # the expert runs on the slots gathered over ESP; backward, the gather and the scatter
        # swap (their duals move the same bytes) and the MP gather's dual sends nothing
        expert, _ = step_load(Step("expert"), shape, replace(held, capacity=c * s.esp))
        load = StepLoad(forward=(a2a, ag, rs, a2a, gather), backward=(a2a, rs, ag, a2a, ()),
                        exchange=True, chunks=max(1, min(s.chunks, c)),
                        flops=expert.flops, moved=expert.moved, gemms=expert.gemms)
        return load, replace(held, capacity=c * s.mp if gather else c)
    raise ValueError(f"unknown plan step {step}")


def _exact_step_load(step: Step, s: LayerShape, held: Held, coll, need) -> tuple:
    """The exact exchange's steps (exchange.py): dispatch only marks the kept pairs, and
    agrees the send counts with one AllGather of small ints over the EP x ESP group, made as
    an AlltoAll to every rank (comm_uneven.gather_counts; priced on EP, whose links it
    crosses); s2's split keeps 1/G of the tokens and their E weights
    (backward: their AllGather); the exchange sends rows = tokens x ep_hit to each EP rank,
    M + L wide, and gets one row of M back for each; the expert runs on the rows' k / EP
    expected (token, expert) pairs per row sent, gathered over ESP; the combine adds the
    returned rows into the tokens."""
    op, b, n = step.op, s.bytes_per_element, held.tokens
    local, pieces = s.experts // s.ep, max(1, min(s.chunks, n))
    if op == Op.DISPATCH:
        per_piece = s.ep + (s.ep // s.relay if s.relay > 1 else 0)  # relayed: per node too
        counts = coll("alltoall", "ep", (2 + pieces * per_piece) * 8)
        return StepLoad(forward=counts, moved=n * s.experts * 4), held
    if op == Op.SPLIT_CAPACITY:
        need(n % s.mp == 0, f"{n} tokens do not split over MP {s.mp}")
        part = n // s.mp
        return (StepLoad(backward=coll("allgather", "mp", part * (s.hidden + s.experts) * b)),
                replace(held, tokens=part))
    rows = n * s.ep_hit()  # per EP destination; a rank receives as many from each sender
    if op == Op.COMBINE:
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
                    exchange=True, chunks=pieces, gemms=s.expert_gemms(),
                    flops=2 * pairs * s.hidden * h * s.matrices, moved=2 * pairs * h * b,
                    local_share=1 / s.ep if local_first else 0.0)
    return load, replace(held, tokens=n * s.mp if gather else n)


def exchange_s(out: tuple, main: float, back: tuple, tail: tuple, chunks: int,
               lanes: int = 1, local: tuple = (0.0, 0.0)) -> float:
    """Seconds of one phase of the "exchange" step over r = chunks pieces. out, back, tail:
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


def _exchange_cost(load: StepLoad, shape: LayerShape, profile: Profile) -> tuple:
    """(forward_s, backward_s) of the exchange step: exchange_s on per-chunk prices, with the
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
        piece_calls, half_calls = _exchange_calls(colls)
        # per piece: the calls' latency and waits, then the rows' transfers and work
        fixed, rows = ag[0] + rs[0], ag[1] + rs[1] + weight * work
        # local first: each chunk keeps the other EP ranks' share of the rows, and each half
        # of this rank's own rows pays one more gather and scatter
        half = fixed + per_call * half_calls + share * r * rows / 2 if share else 0.0
        first = half + (shared if weight == 1 else 0.0)
        phases.append(exchange_s(out, fixed + per_call * piece_calls + (1 - share) * rows,
                                 back, tail, r, profile.lanes, (first, half)) + weight * host)
    return tuple(phases)


def step_cost(step: Step, shape: LayerShape, profile: Profile, held: Held) -> tuple:
    """(forward_s, backward_s) of one step, entered holding `held` (see walk)."""
    load, _ = step_load(step, shape, held)
    if load.exchange:
        return _exchange_cost(load, shape, profile)
    compute = _work_s(load.flops, load.moved, profile, load.gemms)
    comm_factor, compute_factor, host, per_call = profile.layer
    compute = compute * compute_factor + host
    return tuple(_phase_s(colls, shape, profile) * comm_factor + per_call * calls(colls, load)
                 + compute * weight
                 for colls, weight in ((load.forward, 1), (load.backward, 2)))


def _exchange_calls(colls: tuple) -> tuple:
    """(calls of one piece, calls of one local half) in a phase of the exchange step: a piece
    makes one of each of its collectives (AlltoAlls, ESP gather and scatter, MP gather), a
    local half (--moe-parm-local-first) its ESP gather and scatter."""
    return sum(len(c) for c in colls), len(colls[1]) + len(colls[2])


def calls(colls: tuple, load: StepLoad) -> int:
    """Collective calls of one phase of a step: the exchange step makes one of each of its
    collectives per piece, and with local first its two halves their ESP calls."""
    if load.exchange:
        piece, half = _exchange_calls(colls)
        return piece * load.chunks + (2 * half if load.local_share else 0)
    return len(colls)


def walk(plan: Plan, shape: LayerShape) -> list:
    """[(step, Held on entering it)] for the plan; shape.sequence_parallel must be the one the
    plan was built with. Raises ValueError for a layout the executor refuses."""
    if any(st.group == "esp" and st.op in (Op.COPY, Op.ALLREDUCE) for st in plan.steps):
        if shape.esp != shape.mp:  # planning/checks.py: ESP ranks need the same tokens
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
    exchange = any(step.op == Op.EXCHANGE for step in plan.steps)
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
            if load.exchange:  # (coll, ...) per stage, each () or ((kind, group, bytes),)
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
