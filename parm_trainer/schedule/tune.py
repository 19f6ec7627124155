"""--moe-parm-schedule auto with no cost profile: measure the candidates at start-up, once.

The default run (no Parm flag) is auto with the pipeline depth chosen too. Given a profile
(--moe-parm-cost-profile), the cost model chooses (auto.py). Without one, every rank builds
this job's MoE layer under each candidate (s1 and s2, or the schedule given, at depths 1, 2
and 4, or the depth given, and at depth 2 with --moe-parm-local-first where the exchange
allows it; those the layout admits), all with one set of weights, times
forward + backward passes on random tokens of the real shape on the real process groups, in
rounds that take every candidate in turn (interleaved_times; a candidate 25 % behind after two
rounds leaves the race), and takes the fastest (the max over ranks of the median, so every
rank makes the same choice), after a run-off of the two fastest where they lie within 10 % of
each other (measured_seconds). That takes seconds. The
result is cached in a JSON file (--moe-parm-tune-cache, default $PARM_TRAINER_CACHE_DIR or
~/.cache/parm_trainer, file moe_tune.json) under a key naming the cluster (world size, ranks
per node, backend, device, host names) and the layer (layout, shape, dtype, exchange), so a
later run of the same layer on the same cluster reads it instead. Rank 0 reads and writes the
cache and broadcasts the choice; the write goes to a temporary file renamed into place. The log
says which path was taken.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import gc
import json
import os
import socket
import statistics
import time
from typing import Callable

import torch

from parm_trainer import moe_flags
from parm_trainer import node_relay
from parm_trainer.schedule.auto import label
from parm_trainer.parallel import rank_device

WARMUP, ROUNDS = 1, 5
DROP_AFTER, DROP_MARGIN = 2, 0.25
RUNOFF_MARGIN, RUNOFF_ROUNDS = 0.10, 6


def cache_path(args) -> str | None:
    """The cache file, or None where caching is off (--moe-parm-tune-cache none)."""
    path = getattr(args, "moe_parm_tune_cache", None)
    if path == "none":
        return None
    if path:
        return path
    root = os.environ.get("PARM_TRAINER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "parm_trainer")
    return os.path.join(root, "moe_tune.json")


def cluster_key(args) -> dict:
    """The cluster part of a cache key: world size, ranks per node, backend, device, host
    names (collective: every rank calls it)."""
    world = torch.distributed.get_world_size()
    hosts = [None] * world
    torch.distributed.all_gather_object(hosts, socket.gethostname())
    device = (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    return {"world": world, "per_node": node_relay.ranks_per_node(args),
            "backend": torch.distributed.get_backend(), "device": device,
            "hosts": sorted(set(hosts))}


def _key(args, candidates) -> str:
    return json.dumps({
        **cluster_key(args),
        "layout": [args.tensor_model_parallel_size, args.expert_model_parallel_size,
                   args.expert_tensor_parallel_size, args.pipeline_model_parallel_size,
                   bool(args.sequence_parallel)],
        "shape": [args.seq_length, args.micro_batch_size, args.hidden_size,
                  args.moe_ffn_hidden_size, args.num_experts, args.moe_router_topk,
                  args.moe_expert_capacity_factor, bool(args.moe_router_pre_softmax),
                  "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"],
        "exchange": args.moe_parm_exchange, "candidates": [list(c) for c in candidates],
        "blocks": moe_flags.config_fields(args),  # shared expert, routing (moe_flags.py)
        # entries timed otherwise are re-measured
        "timing": f"interleaved {WARMUP}+{ROUNDS} shuffled, out after {DROP_AFTER} if "
                  f"{DROP_MARGIN:.0%} over, run-off {RUNOFF_ROUNDS} within {RUNOFF_MARGIN:.0%}, "
                  "one set of weights"},
        sort_keys=True)


def _valid(entry) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("choice"), list) and \
        len(entry["choice"]) == 3 and isinstance(entry.get("measured_ms"), dict)


def read_cached(path, key, valid=_valid):
    """The cache file's entry for key, or None (no file, no entry, or one `valid` refuses)."""
    try:
        with open(path) as f:
            entry = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return entry if valid(entry) else None


def write_cached(path, key, entry, valid=_valid) -> dict:
    """Add the entry to the cache file and return the entry the file holds for the key: jobs
    that share the file (two on one machine) take turns under a lock on a file beside it, so
    neither drops the other's entry, and where another job measured the same layer meanwhile,
    its entry stays and is returned (every job of that layer then makes one choice)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            with open(path) as f:
                table = json.load(f)
            if not isinstance(table, dict):
                table = {}
        except (OSError, ValueError):
            table = {}
        if valid(table.get(key)):
            return table[key]
        table[key] = entry
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1)
        os.replace(tmp, path)
    return entry


def sync_device():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_times(candidates: list, run, warmup: int = WARMUP,
                      rounds: int = ROUNDS) -> dict:
    """{candidate: [what each of `rounds` timed runs returned]} (run(candidate) -> its seconds,
    or any figures), after `warmup` untimed runs of every candidate. Each round times every
    candidate once, in the order round_order gives, so that a slow stretch of the machine (or
    the first use of a process group) touches the candidates alike instead of falling on all
    of one's passes; Python's automatic collector paused meanwhile (collector_paused)."""
    times = {candidate: [] for candidate in candidates}
    with collector_paused():
        for candidate in candidates:
            for _ in range(warmup):
                run(candidate)
        for k in range(rounds):
            for candidate in round_order(candidates, k):
                times[candidate].append(run(candidate))
    return times


def round_order(items: list, k: int) -> list:
    """The order of round k, the same on every rank (the runs are collective): a Williams
    design, whose rounds 2i and 2i + 1 are the sequence 0, 1, n-1, 2, n-2, ... shifted by i,
    forward then reversed, so that over 2n rounds each item follows each other one exactly
    twice. A pass carries what the one before it leaves behind (memory it freed, the state of
    the connections it used: a layer timed after s2 at depth 4 ran 2-7 % slower than the same
    layer timed after s1 at depth 2, in the same launch). A rotation keeps one cyclic order;
    shuffles seeded by the round put the first of three candidates (TP 1: s1 at depths 1, 2
    and 4) after the third in 4 of 5 rounds."""
    n = len(items)
    first = [0]
    for j in range(1, n):
        first.append((j + 1) // 2 if j % 2 else n - j // 2)
    row = [(j + k // 2) % n for j in first]
    return [items[j] for j in (row[::-1] if k % 2 else row)]


def measured_seconds(candidates: list, run, reduce=lambda seconds: seconds) -> tuple:
    """({candidate: seconds}, the two candidates of the run-off or ()): the medians of
    interleaved_times, reduced over ranks (reduce maps a list of per-candidate figures to the
    list every rank agrees on: the max over ranks). After DROP_AFTER rounds a candidate whose
    fastest pass so far is still more than DROP_MARGIN over the best median leaves the race
    (its seconds: the median of its passes so far); most of a start-up's passes used to go to
    depth-4 and local-first candidates two or three times slower than the best. Where the
    runner-up lies within RUNOFF_MARGIN of the fastest, RUNOFF_ROUNDS more interleaved runs of
    the two alone, their medians then over all their runs. Five runs each leave the medians
    5-10 % apart from one launch to the next on a shared machine, as much as two depths or
    schedules often differ: the run-off spends its seconds only on such a close call."""
    times = interleaved_times(candidates, run, rounds=min(DROP_AFTER, ROUNDS))

    def reduced(which, figure=statistics.median) -> dict:
        return dict(zip(which, reduce([figure(times[c]) for c in which])))

    racing = list(candidates)
    if len(candidates) > 1 and ROUNDS > DROP_AFTER:
        best = min(reduced(candidates).values())
        fastest = reduced(candidates, min)
        racing = [c for c in candidates if fastest[c] <= best * (1 + DROP_MARGIN)]
        if len(racing) > 1:
            for candidate, more in interleaved_times(racing, run, warmup=0,
                                                     rounds=ROUNDS - DROP_AFTER).items():
                times[candidate] += more
    seconds = reduced(candidates)
    if len(racing) > 1:
        first, second = sorted(racing, key=seconds.get)[:2]
        if seconds[second] <= seconds[first] * (1 + RUNOFF_MARGIN):  # the same on every rank
            for candidate, more in interleaved_times([first, second], run, warmup=0,
                                                     rounds=RUNOFF_ROUNDS).items():
                times[candidate] += more
            return reduced(candidates), (first, second)
    return seconds, ()


def _build(args, config, name, device):
    """The job's MoE layer under schedule `name` (its depth is set per pass)."""
    from parm_trainer.models.gpt import moe_module_spec
    from parm_trainer.moe.layer import ParmMoELayer

    layer = ParmMoELayer(config, moe_module_spec(args).submodules, layer_number=1,
                         schedule=name, chunks=1, exchange=args.moe_parm_exchange).to(device)
    return layer.to(args.params_dtype)  # the training's dtype (fp32, bf16 or fp16)


def _layers(args, config, names, device) -> dict:
    """{schedule: its layer} for the distinct names, one layer per schedule (the depth is a
    plain attribute), every one with the first one's weights: the same routing and experts,
    so that the schedules are timed on the same work (two draws of the weights route the
    tokens differently, enough to change which schedule is faster on a close call)."""
    layers = {name: _build(args, config, name, device) for name in dict.fromkeys(names)}
    first, *others = layers.values()
    for layer in others:
        layer.load_state_dict(first.state_dict())
    return layers


def _measure(args, candidates) -> tuple:
    """Seconds of one forward + backward of the layer per candidate: the median of ROUNDS
    interleaved passes (and a run-off's, measured_seconds) on random tokens of the real shape
    on the real process groups, max over ranks (so every rank makes the same choice); and the
    run-off's two candidates, or ()."""
    from parm_trainer.models.config import transformer_config

    config = transformer_config(args)
    device = torch.device(rank_device())
    layers = _layers(args, config, [name for name, *_ in candidates], device)
    seq = args.seq_length // (args.tensor_model_parallel_size if args.sequence_parallel else 1)
    gen = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())
    x = torch.randn(seq, args.micro_batch_size, args.hidden_size, generator=gen).to(
        device, args.params_dtype)

    def run(candidate) -> float:
        name, chunks, local, *overlap = candidate  # (..., shared expert overlapped)
        layer = layers[name]
        layer.chunks, layer.local_first = chunks, local
        layer.shared_overlap = bool(overlap[0] if overlap else  # as forced, if it is
                                    getattr(args, "moe_shared_expert_overlap", False))
        x_i = x.detach().requires_grad_()
        torch.distributed.barrier()
        start = time.perf_counter()
        out, _ = layer(x_i)
        out.backward(torch.ones_like(out))
        sync_device()
        return time.perf_counter() - start

    return measured_seconds(list(candidates), run, max_over_ranks)


@contextlib.contextmanager
def collector_paused():
    """Python's automatic garbage collector off while passes are timed. Start-up has
    not yet frozen its objects (training does: manual_gc.freeze_startup), so a full collection
    here walks about a million of them, a pause of tens of milliseconds on one rank that every
    rank then waits for at the next collective, falling on whichever pass crossed the
    threshold: on 2 x 4 emulated nodes s1 at depth 1 timed 115-210 ms from one pass to the
    next, and its median 13-48 % behind depth 2's, where it trains 6 % faster."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def max_over_ranks(figures: list) -> list:
    """Each figure's largest value over the ranks (every rank then makes the same choice)."""
    seconds = torch.tensor(figures, dtype=torch.float64, device=torch.device(rank_device()))
    torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
    return seconds.tolist()


@contextlib.contextmanager
def timing_layers(args):
    """Around timed passes of MoE layers built outside the model: the aux loss's backward
    scale at 1, megatron's RNG tracker seeded; afterwards the aux losses the passes logged
    dropped, entries they opened removed (megatron sizes an entry by the first layer count it
    sees: a model of fewer layers than the run's would leave one too short), and the scale as
    it was (the training's own passes start clean)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    before = set(tracker)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    model_parallel_cuda_manual_seed(args.seed)
    try:
        yield
    finally:
        for name in set(tracker) - before:
            del tracker[name]
        moe_utils.clear_aux_losses_tracker()
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


def runnable_candidates(args) -> list:
    """Of args.moe_parm_tune_candidates, those validate_layout admits for this job."""
    from parm_trainer.errors import LayoutError
    from parm_trainer.planning.checks import validate_layout

    out = []
    for name, r, local in args.moe_parm_tune_candidates:
        trial = copy.copy(args)
        trial.moe_parm_schedule, trial.moe_parm_chunks = name, r
        trial.moe_parm_local_first = local
        try:
            validate_layout(trial)
        except LayoutError:
            continue
        out.append((name, r, local))
    return out



def _overlap_open(args) -> bool:
    """Whether the shared expert's place is left to measure: a shared expert, and neither
    --moe-shared-expert-overlap forcing it nor --recompute-modules shared_experts ruling it
    out."""
    return (getattr(args, "moe_shared_expert_intermediate_size", None) is not None
            and not getattr(args, "moe_shared_expert_overlap", False)
            and not moe_flags.shared_experts_recomputed(args))


def _measure_overlap(args, best) -> dict:
    """The chosen candidate with the shared expert before the gate and overlapped with the
    exchange, timed as the candidates are: {"shared_overlap": the faster is overlapped,
    "shared_overlap_ms": [before, overlapped]}."""
    pair = [(*best, False), (*best, True)]
    with timing_layers(args):
        seconds, _ = _measure(args, pair)
    before, overlapped = (seconds[c] for c in pair)
    return {"shared_overlap": overlapped < before,
            "shared_overlap_ms": [round(before * 1e3, 3), round(overlapped * 1e3, 3)]}


def cached_or_measured(path, key: str, measure: Callable[[], dict], valid=_valid,
                       measured: str = "measured now") -> tuple:
    """(entry, where it came from for the log): the cache's entry for key, which rank 0 reads
    and every rank gets, or measure() now (every rank), written to the cache by rank 0 (where
    another job wrote the same key meanwhile, its entry wins, for every rank) and shared.
    Collective: every rank calls it."""
    rank0 = torch.distributed.get_rank() == 0
    cached = [read_cached(path, key, valid) if rank0 and path else None]
    torch.distributed.broadcast_object_list(cached, src=0)
    if cached[0] is not None:
        return cached[0], f"cached in {path}"
    start = time.perf_counter()
    entry = measure()
    source = f"{measured} in {time.perf_counter() - start:.1f} s"
    if rank0 and path:
        try:
            mine, entry = entry, write_cached(path, key, entry, valid)
            source += (f", cached in {path}" if entry is mine else
                       f"; another job cached its own measurement in {path} meanwhile, "
                       "which is used")
        except OSError as error:
            source += f" (not cached: {error.strerror} for {path})"
    if path:  # rank 0's entry, the cache's where another job wrote first
        shared = [entry, source]
        torch.distributed.broadcast_object_list(shared, src=0)
        entry, source = shared
    return entry, source


def tune_at_startup(args, log=print) -> None:
    """Resolve what auto.resolve_auto_schedule left to measure (args.moe_parm_tune_candidates):
    from the cache, or measured now and cached. Collective: every rank calls it."""
    if not getattr(args, "moe_parm_tune_candidates", None):
        return
    candidates = runnable_candidates(args)
    if not candidates:
        from parm_trainer.errors import LayoutError

        raise LayoutError(f"--moe-parm-schedule {args.moe_parm_schedule}: none of "
                         f"{args.moe_parm_tune_candidates} can run this layout")
    def measure() -> dict:
        with timing_layers(args):
            measured, run_off = _measure(args, candidates)
        best = min(measured, key=measured.get)
        entry = {"choice": list(best), "measured_ms": {label(*c): round(s * 1e3, 3)
                                                     for c, s in measured.items()},
                 "run_off": [label(*c) for c in run_off],
                 "when": time.strftime("%Y-%m-%d %H:%M:%S")}
        if _overlap_open(args):
            entry.update(_measure_overlap(args, best))
        return entry

    entry, source = cached_or_measured(cache_path(args), _key(args, candidates), measure,
                                       measured="measured at start-up")
    name, r, local = entry["choice"]
    times = ", ".join(f"{c} {ms:.2f} ms" for c, ms in entry["measured_ms"].items())
    run_off = entry.get("run_off")
    if run_off:
        times += f" ({' and '.join(run_off)} within {RUNOFF_MARGIN * 100:.0f} %: "\
                 f"{RUNOFF_ROUNDS} more runs each)"
    if "shared_overlap_ms" in entry:
        before, overlapped = entry["shared_overlap_ms"]
        times += (f"; {name} r={r} with the shared expert before the gate {before:.2f} ms, "
                  f"overlapped with the exchange {overlapped:.2f} ms")
    overlap = bool(entry.get("shared_overlap"))
    log(f"--moe-parm-schedule {args.moe_parm_schedule} --moe-parm-chunks "
        f"{args.moe_parm_chunks}: forward+backward per MoE layer {times} ({source}); "
        f"using {name} with --moe-parm-chunks {r}" + (" --moe-parm-local-first" if local else "")
        + (" --moe-shared-expert-overlap" if overlap else ""))
    args.moe_shared_expert_overlap = args.moe_shared_expert_overlap or overlap
    args.moe_parm_schedule, args.moe_parm_chunks = name, int(r)
    args.moe_parm_local_first = bool(local)
    args.moe_parm_tune_candidates = None
