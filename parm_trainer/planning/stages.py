"""The stage builder: split a model's pieces into pipeline stages so that the slowest stage is
as fast as it can be, and hand megatron-core its own layout string ("Ettt|tt|ttL").

The pieces (model_cost.py: E, every decoder layer, L) are priced per micro-batch on one rank;
a stage is a run of consecutive pieces, E on the first, L on the last (a stage may hold only
E or only L, as in megatron's own layouts). Dynamic programming over the split points, as
PipeDream and Alpa partition: best[k][j] = the smallest possible largest stage time when the
first j pieces form k stages, each stage under an optional memory limit (its parameters,
gradients and optimizer state plus the activations of the micro-batches it holds in flight:
P - k under 1F1B for stage k; for an interleaved rank each chunk at its most, from megatron's
schedule table; predict() takes the peak of their sum over the schedule). With V virtual
stages per rank (interleaved 1F1B) the pieces are split into P x V chunks the same way;
megatron places chunk c on rank c mod P.

Iteration time (predict): with t_r a rank's time per micro-batch (its chunks, plus the P2P
transfers at its chunk boundaries, each priced for the rank pairs that cross it at once) and m
micro-batches, (m V - 1) x max t_r / V plus one micro-batch's pass through every rank, sum t_r /
V (_pipeline_steps; (m + (P - 1) / V) x max t_r for balanced stages; where ranks share cores,
the schedule, plain or interleaved, played out task by task instead, pipeline_sim.py: ranks in
a bubble leave the cores to those computing), plus the slowest rank's gradient reduction (with
a tied embedding, the first and last ranks' all-reduce of its gradient too) and optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parm_trainer.planning import recompute_choice, recompute_cost
from parm_trainer.planning.model_cost import ModelCost
from parm_trainer.planning.rank_memory import entries
from parm_trainer.planning.recompute_choice import Priced
from parm_trainer.planning.pipeline_sim import one_f_one_b, table, warmup


class NoSplitFits(ValueError):
    """No split meets the constraints; the message says which."""


@dataclass
class Stage:
    pieces: list
    forward_s: float
    backward_s: float
    params: float
    memory_bytes: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def _stage_params(pieces, tied: bool) -> tuple:
    """(parameters, expert parameters) of a run; tied, E and L on one stage share one word
    embedding matrix (L's piece counts its own copy, as a later stage holds one)."""
    params = sum(p.params for p in pieces)
    embedding = [p.params for p in pieces if p.kind == "E"]
    if tied and embedding and pieces[-1].kind == "L":
        params -= embedding[0]
    return params, sum(p.expert_params for p in pieces)


def split(pieces: list, stages: int, cost: ModelCost, in_flight: list = None,
          memory_limit_bytes: float = None, tied: bool = True, priced=None) -> list:
    """The pieces in `stages` runs (lists) minimising the largest run's time, each under
    memory_limit_bytes with in_flight[k] micro-batches' activations on run k. priced(run):
    the run as a stage prices it (full recompute's pieces, recompute_cost.full), where the
    pieces alone do not say (a recomputed part's transient bytes count too)."""
    n = len(pieces)
    if stages > n:
        raise NoSplitFits(f"{stages} pipeline stages for {n - 2} decoder layers plus the "
                          "embedding and the output layer: at most one stage per piece")
    in_flight = in_flight or [1] * stages
    times = [0.0]
    for p in pieces:
        times.append(times[-1] + p.total_s)
    runs = {}

    def run_of(i, j) -> tuple:  # (time, state bytes, activation bytes, transient bytes)
        if (i, j) not in runs:
            run = pieces[i:j] if priced is None else priced(pieces[i:j])
            params, experts = _stage_params(run, tied)
            runs[i, j] = (times[j] - times[i] if priced is None else
                          sum(p.total_s for p in run), cost.state_bytes(params, experts),
                          sum(p.activation_bytes for p in run),
                          recompute_cost.transient(run) if priced else 0.0)
        return runs[i, j]

    def memory(i, j, k):
        _, state, activations, transient = run_of(i, j)
        return state + in_flight[k] * activations + transient

    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                if memory_limit_bytes is not None and memory(i, j, k - 1) > memory_limit_bytes:
                    continue
                value = max(best[k - 1][i], run_of(i, j)[0])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[stages][n] == inf:
        raise NoSplitFits(f"no split into {stages} stages fits the memory limit of "
                          f"{memory_limit_bytes / 2**30:.3g} GiB per rank")
    runs, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        runs.append(pieces[i:j])
        j = i
    return runs[::-1]


def even_split(pieces: list, stages: int) -> list:
    """megatron's default: the decoder layers split evenly, E on the first stage, L on the
    last."""
    layers = pieces[1:-1]
    if len(layers) % stages:
        raise NoSplitFits(f"{len(layers)} layers do not split evenly into {stages} stages")
    size = len(layers) // stages
    runs = [layers[k * size:(k + 1) * size] for k in range(stages)]
    runs[0] = [pieces[0], *runs[0]]
    runs[-1] = [*runs[-1], pieces[-1]]
    return runs


def layout_string(runs: list) -> str:
    """megatron-core's pipeline_model_parallel_layout for the runs (stages in order)."""
    return "|".join("".join({"E": "E", "L": "L"}.get(p.kind, "t") for p in run) for run in runs)


def live_micro_batches(pp: int, vp: int, microbatches: int, rank: int) -> list:
    """The micro-batches each of `rank`'s vp chunks holds (forward run, backward not yet) after
    every forward step of megatron-core's schedule: 1F1B's P - rank - 1 warm-up forwards, or,
    interleaved, (P - rank - 1) x 2 + (V - 1) x P of them in the order of its schedule table
    (groups of P micro-batches, chunk by chunk; the backward mirrors the chunks), then one
    forward and one backward at a time, then the remaining backwards."""
    order = [chunk for _, chunk in table(pp, vp, microbatches)]
    warm, total = warmup(pp, vp, microbatches, rank), microbatches * vp
    live, snapshots, backward = [0] * vp, [], 0
    for step in range(total):
        live[order[step]] += 1
        snapshots.append(list(live))
        if step >= warm:
            live[vp - 1 - order[backward]] -= 1
            backward += 1
    return snapshots


def in_flight(pp: int, vp: int, microbatches: int) -> list:
    """Per chunk (megatron's order: chunk c on rank c mod P), the most micro-batches it holds
    at once (P - k on stage k under 1F1B)."""
    most = [[max(column) for column in zip(*live_micro_batches(pp, vp, microbatches, rank))]
            for rank in range(pp)]
    return [most[c % pp][c // pp] for c in range(pp * vp)]


def predict(runs: list, cost: ModelCost, pp: int, vp: int, microbatches: int,
            tied: bool = True) -> dict:
    """Per rank and per iteration: {"ranks": [{time_s (compute_s and the P2P transfers),
    memory_bytes (= weights_grads_bytes + optimizer_bytes + activation_bytes, the last with
    in_flight micro-batches held at the rank's peak), params, expert_params, sync_s}],
    "iteration_s"}."""
    ranks = _rank_times(runs, cost, pp, tied)
    for r, rank in enumerate(ranks):  # the peak over the schedule of the chunks' live sum
        per_chunk = [sum(p.activation_bytes for p in runs[v * pp + r]) for v in range(vp)]
        peak = max(live_micro_batches(pp, vp, microbatches, r),
                   key=lambda snap: sum(n * b for n, b in zip(snap, per_chunk)))
        rank["in_flight"] = sum(peak)
        rank["activation_bytes"] = sum(n * b for n, b in zip(peak, per_chunk))
        rank["weights_grads_bytes"], rank["optimizer_bytes"] = cost.state_parts(
            rank["params"], rank["expert_params"])
        rank["memory_bytes"] = (rank["weights_grads_bytes"] + rank["optimizer_bytes"]
                                + rank["activation_bytes"])
        rank["sync_s"] = cost.gradient_sync_s(rank["params"], rank["expert_params"])
        if tied and r in (0, pp - 1):
            rank["sync_s"] += cost.embedding_sync_s()
    steps = _pipeline_steps(runs, cost, pp, vp, microbatches, ranks)
    iteration = sum(steps) + max(r["sync_s"] for r in ranks)
    return {"ranks": ranks, "iteration_s": iteration, "steps_s": steps}


def _rank_times(runs: list, cost: ModelCost, pp: int, tied: bool = True) -> list:
    """Per pipeline rank: its chunks' compute per micro-batch, their P2P transfers (a send
    and a receive at each chunk boundary, priced for the rank pairs of that boundary; each
    chunk's p2p_s apart too, and its send_s: the transfer to the next chunk) and
    parameters."""
    ranks = [{"time_s": 0.0, "compute_s": 0.0, "forward_s": 0.0, "backward_s": 0.0,
              "p2p_s": 0.0, "params": 0.0, "expert_params": 0.0, "chunks": []}
             for _ in range(pp)]
    for c, run in enumerate(runs):
        rank = ranks[c % pp]
        compute = sum(p.total_s for p in run)
        send = cost.p2p_s(c % pp, (c + 1) % pp) if c + 1 < len(runs) else 0.0
        p2p = send + (cost.p2p_s(c % pp, (c - 1) % pp) if c else 0.0)  # and the receive
        chunk = {"forward_s": sum(p.forward_s for p in run) + p2p,
                 "backward_s": sum(p.backward_s for p in run) + p2p, "p2p_s": p2p,
                 "send_s": send}
        rank["chunks"].append(chunk)
        rank["compute_s"] += compute
        rank["p2p_s"] += 2 * p2p
        rank["time_s"] += compute + 2 * p2p
        rank["forward_s"] += chunk["forward_s"]
        rank["backward_s"] += chunk["backward_s"]
        params, experts = _stage_params(run, tied)
        rank["params"] += params
        rank["expert_params"] += experts
    return ranks


def overlapped_p2p(args, vp: int) -> bool:
    """Whether megatron runs the P2P transfers beside the compute: its interleaved schedule
    with overlap_p2p_comm (models/config.py: on unless --no-overlap-p2p-communication)."""
    return vp > 1 and getattr(args, "overlap_p2p_comm", True)


def _pipeline_steps(runs, cost, pp, vp, microbatches, ranks) -> list:
    """1F1B's time as steps: each micro-batch after the first adds the slowest rank's time
    (the steady state), and one micro-batch's pass through every rank adds each rank's own
    forward (in the warm-up, r + 1 ranks working) and backward (in the cool-down, P - r):
    (m V - 1) max t_r / V + sum t_r / V, which is (m + (P - 1) / V) max t_r for balanced
    stages and less where only some are slow (DAPPLE's and Alpa's estimate).
    Where ranks share cores (Profile.compute_concurrency), a stage's ranks compute in
    lock-step (the same work between the same collectives), so one stage alone, PP = 1,
    computes at the factor of all its ranks however long it waits on links; over several
    stages the schedule, plain or interleaved, is played out task by task instead
    (_played_out, pipeline_sim.py: other stages' ranks count by the share of their task they
    compute): one step, its makespan."""
    size = cost.args.world_size // pp
    lengths = [len(run) for run in runs]
    priced = {1.0: ranks}
    chunks, overlap = microbatches * vp, overlapped_p2p(cost.args, vp)

    def times(factor):
        factor = round(factor, 3)
        if factor not in priced:
            scaled = cost.scaled(factor)
            pieces, at, again = scaled.pieces(), 0, []
            for n in lengths:
                again.append(pieces[at:at + n])
                at += n
            priced[factor] = _rank_times(again, scaled, pp)
        return priced[factor]

    if cost.profile.compute_concurrency and pp > 1:
        return [_played_out(ranks, times(1e-3), pp, vp, microbatches, size, cost.profile,
                            overlap)]

    def working(active):
        """The rank times with `active` pipeline ranks working, every rank of theirs computing
        at once (a stage's ranks run in lock-step; on shared cores only PP = 1 gets here)."""
        return times(cost.profile.concurrency(active * size))

    steady = max(r["time_s"] - (r["p2p_s"] if overlap else 0.0)
                 for r in working(min(pp, chunks)))
    steps = [steady / vp] * (chunks - 1)
    for r in range(pp):  # the warm-up and cool-down: P2P blocking in either schedule
        steps.append((working(min(r + 1, chunks))[r]["forward_s"]
                      + working(min(pp - r, chunks))[r]["backward_s"]) / vp)
    return steps


def _played_out(ranks, waiting, pp, vp, microbatches, size, profile,
                overlap: bool = False) -> float:
    """1F1B, plain or interleaved, on ranks that share cores, task by task (pipeline_sim.py):
    each chunk's compute is its time less `waiting`, its time with compute (nearly) free: links
    and peers. Stage s is chunk s // P of rank s % P."""
    stages = [(ranks[s % pp]["chunks"][s // pp], waiting[s % pp]["chunks"][s // pp])
              for s in range(pp * vp)]
    work = [{"F": c["forward_s"] - w["forward_s"], "B": c["backward_s"] - w["backward_s"]}
            for c, w in stages]
    p2p = [w["p2p_s"] if overlap else 0.0 for _, w in stages]  # played out apart (below)
    other = [{"F": w["forward_s"] - x, "B": w["backward_s"] - x} for (_, w), x in zip(stages, p2p)]
    transfer = [c["send_s"] for c, _ in stages] if overlap else None
    return one_f_one_b(work, other, pp, microbatches, size, profile.concurrency, vp, transfer)


def price_split(args, cost: ModelCost, pp: int, vp: int, microbatches: int,
                limit: float = None, tied: bool = True) -> Priced:
    """The split of least predicted iteration time for args' model under its recompute
    flags, each stage under limit (bytes per rank), priced as the start-up estimate prices
    it (rank_memory.py); raises NoSplitFits."""
    kept = recompute_cost.kept_input(cost)
    recomputed = recompute_choice.user_given(args)
    runs = split(cost.pieces(), pp * vp, cost, in_flight(pp, vp, microbatches), limit, tied,
                 priced=(lambda run: recompute_cost.full(args, [run], kept)[0]) if recomputed
                 else None)
    priced = recompute_cost.full(args, runs, kept)
    predicted = predict(priced, cost, pp, vp, microbatches, tied)
    return Priced(runs, predicted, entries(args, cost, priced, predicted, microbatches))


def auto_layout(args, log=print) -> str:
    """--pipeline-model-parallel-layout auto: the split of least predicted iteration time for
    args' model, PP and virtual stages, priced with --moe-parm-cost-profile (or the built-in
    default profile); logs the layout and each stage's predicted time and memory. Under
    --memory-gb, where the split without recomputation does not fit, the recompute setting
    of least predicted time that does (recompute_choice.py), set in args and logged."""
    from parm_trainer.moe.cost_profile import load_profile, profile_source

    profile = load_profile(args)
    pp = args.pipeline_model_parallel_size
    vp = getattr(args, "num_virtual_stages_per_pipeline_rank", None) or 1
    microbatches = args.global_batch_size // (args.micro_batch_size * ModelCost(
        args, profile).dp)
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    limit = args.memory_gb * 2**30 if getattr(args, "memory_gb", None) else None
    chosen = recompute_choice.choose(
        args, lambda trial, most: price_split(trial, ModelCost(trial, profile), pp, vp,
                                              microbatches, most, tied), limit, NoSplitFits)
    if chosen.setting is not None:
        recompute_choice.apply(args, chosen.setting)
        log(recompute_choice.describe(chosen, limit))
    layout, result = layout_string(chosen.runs), chosen.predicted
    source = profile_source(args, profile)
    stages = "; ".join(f"rank {r}: {rank['time_s'] * 1e3:.2f} ms per micro-batch, "
                       f"{memory['total'] / 2**20:.1f} MiB"
                       for r, (rank, memory) in enumerate(zip(result["ranks"], chosen.ranks)))
    log(f"--pipeline-model-parallel-layout auto: {layout} (predicted with {source}: {stages}; "
        f"{result['iteration_s'] * 1e3:.1f} ms per iteration)")
    return layout
