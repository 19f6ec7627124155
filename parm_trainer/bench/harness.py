"""One MoE layer, forward and backward, under every row of --schedules and --peers in one
launch: each row gets the same full weights and data (weights.py), is checked against the
single-process reference (replica.py), timed with the others interleaved (timing.py), and its
collectives' bytes counted (ledger.py). A row that cannot run the layout is skipped with the
reason.

    runs, payload = run(args)      # args: flags.parse(argv); payload is what --json gets
"""

from __future__ import annotations

import copy
import os

import torch

from parm_trainer.bench import ledger, peers
from parm_trainer.bench.features import SharedWeights, check_against_megatron
from parm_trainer.bench.layout import device as current_device
from parm_trainer.bench.layout import ensure_distributed, gather_mp, max_over_ranks, set_layout
from parm_trainer.bench.peers import PeerCannotRun, megatron
from parm_trainer.bench.replica import (Replica, clear_tracker, compare_layer, gate_calls,
                                        output_diffs, tracked_aux)
from parm_trainer.bench.report import config_summary, row_ratios
from parm_trainer.bench.results import DIFF_KEYS
from parm_trainer.bench.timing import time_schedules, time_steps, timed_step
from parm_trainer.bench.weights import dump_inputs, dump_result, full_weights, load_weights


def _trial(args, name):
    """args for one row: megatron-alltoall / megatron-allgather are megatron-core's MoELayer
    with that token dispatcher; s1/r2 is s1 at depth 2; auto is the schedule (and, with
    --moe-parm-chunks 0, the pipeline depth) the cost model picks for this layer, from
    --moe-parm-cost-profile or the built-in profile."""
    from parm_trainer.bench.flags import depth_row, shared_row
    from parm_trainer.schedule.auto import resolve_auto_schedule

    trial = copy.copy(args)
    trial.peer = peers.deepspeed_mode(name)
    if trial.peer:
        return trial
    name, overlap = shared_row(name)
    if overlap is not None:
        trial.moe_shared_expert_overlap = overlap
    if name in peers.MEGATRON:
        megatron.configure(trial, name)
    elif depth := depth_row(name):
        trial.moe_parm_schedule, trial.moe_parm_chunks, trial.moe_parm_local_first = depth
    else:
        trial.moe_parm_schedule = name
    said = []
    resolve_auto_schedule(trial, log=said.append)
    trial.auto_choice = said[0] if said else None
    return trial


def _tune_pending(runnable, results):
    """Trials auto left to be measured (no cost profile): measured now, on this layout, as a
    training run does at start-up (parm_trainer/schedule/tune.py); one none of whose candidates can
    run is reported as skipped."""
    from parm_trainer.schedule.tune import tune_at_startup
    from parm_trainer.errors import LayoutError

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


def build_layer(name, config, args):
    from parm_trainer.models.gpt import moe_module_spec
    from parm_trainer.moe.layer import ParmMoELayer

    spec = moe_module_spec(args)
    if name == "megatron":
        layer = megatron.build(config, spec.submodules)
    else:
        layer = ParmMoELayer(config, spec.submodules, layer_number=1, schedule=name,
                             chunks=args.moe_parm_chunks, exchange=args.moe_parm_exchange,
                             local_first=args.moe_parm_local_first,
                             shared_overlap=getattr(args, "moe_shared_expert_overlap", False))
    layer.set_layer_number(1)  # as TransformerLayer does; the router tracks its aux loss by it
    return layer


def run_schedule(name, args, replica, weights, device, dump_dir, shared=None):
    """A Parm schedule or megatron-core's layer: one checked iteration (its bytes counted),
    and the step to time. Returns (result, step)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from parm_trainer.models.config import transformer_config
    from parm_trainer.moe.comm import LEDGER

    layer = build_layer(args.moe_parm_schedule, transformer_config(args), args)
    shards = load_weights(layer, weights, args)
    if shared is not None:
        shared.load(layer)
    layer.to(device)
    layer.train()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
    sp = args.sequence_parallel
    x_local = replica.local(replica.input, sp).to(args.params_dtype)
    g_local = replica.local(replica.output_grad, sp).to(args.params_dtype)
    step = timed_step(layer, lambda x: layer(x)[0], x_local, g_local)

    # One iteration for correctness and bytes.
    clear_tracker()
    LEDGER.reset()
    x, out, _, _ = step()
    sent_local, received_local = ledger.snapshot(), ledger.snapshot("received")
    aux = tracked_aux(device)
    if args.beyond_reference:  # checked against megatron's row once every row ran
        full_out = gather_mp(out.detach(), args.sequence_parallel).float()
        full_in_grad = gather_mp(x.grad.detach(), args.sequence_parallel).float()
        diffs, scale, rel = ({key: None for key in DIFF_KEYS} for _ in range(3))
    else:
        ref = replica.reference(gate_calls(args.moe_parm_schedule, args))
        diffs, scale, rel, full_out, full_in_grad = compare_layer(layer, shards, x, out, aux,
                                                                  ref, args)
    dump_result(dump_dir, name, full_out, full_in_grad)
    del x, out
    sent, received, cross = ledger.gather_row_bytes(sent_local, received_local,
                                                    getattr(layer, "groups", None))
    counted = args.moe_parm_schedule != "megatron"
    result = {
        "status": "ok",
        "plan": str(layer.plan) if hasattr(layer, "plan") else megatron.describe(args),
        "chunks": args.moe_parm_chunks,
        "local_first": bool(args.moe_parm_local_first),
        "experts": type(layer.experts).__name__,  # SequentialMLP, GroupedMLP, TEGroupedMLP
        "auto_choice": args.auto_choice,
        "forward_ms": None,
        "backward_ms": None,
        "total_ms": None,
        "bytes": ledger.bytes_report(sent) if counted else None,
        "bytes_received": ledger.bytes_report(received) if counted else None,
        # the busiest node's outgoing bytes (forward + backward) and their time on its link
        "cross_node_bytes": cross,
        "max_abs_diff": diffs,
        "reference_max_abs": scale,
        # |got - reference| / |reference| (L2 norms): the measure for --bf16, where a
        # token whose top-k ties differently in bf16 changes a max abs diff but not this
        "rel_l2_diff": rel,
        "aux_loss": None if aux is None else aux.item(),
    }
    if args.beyond_reference:
        result["_full"] = (full_out, full_in_grad)
    return result, step


def run_peer(name, args, replica, weights, device, dump_dir):
    """A DeepSpeed MoE layer (peers/deepspeed.py) on the same weights and input, its output
    and input grad checked against the reference. Its objective leaves out the aux loss:
    DeepSpeed's top-2 aux loss is GShard's, not megatron-core's (a definition, not an error),
    so the reference is taken without it too; gate, expert and aux comparisons are left to
    Parm's rows. Its collectives are DeepSpeed's own, outside the byte ledger."""
    from parm_trainer.bench.peers import deepspeed

    layer = deepspeed.build(args.peer, args, weights, device)
    sp = args.sequence_parallel
    x_local = replica.local(replica.input, sp)
    g_local = replica.local(replica.output_grad, sp)
    step = timed_step(layer, lambda x: deepspeed.forward(layer, x)[0], x_local, g_local)

    x, out, _, _ = step()
    ref = replica.reference(1, aux=False)  # DeepSpeed gates every MP rank's full token set
    full_out, full_in_grad = gather_mp(out.detach(), sp), gather_mp(x.grad.detach(), sp)
    diffs = {key: None for key in DIFF_KEYS}
    scale = dict(diffs)
    local, ref_scale = output_diffs(full_out, full_in_grad, ref)
    for key in local:
        diffs[key], scale[key] = max_over_ranks(local[key]), ref_scale[key]
    dump_result(dump_dir, name, full_out, full_in_grad)
    result = {"status": "ok", "plan": f"deepspeed.moe.layer.MoE ({args.peer})",
              "chunks": None, "auto_choice": None, "forward_ms": None, "backward_ms": None,
              "total_ms": None,
              "bytes": None, "cross_node_bytes": None, "max_abs_diff": diffs,
              "reference_max_abs": scale, "aux_loss": None}
    return result, step


def _runnable(args, results):
    """[(row, trial args)] of the rows whose layout checks pass; the others go to results as
    skipped with the reason."""
    from parm_trainer.errors import LayoutError
    from parm_trainer.planning.checks import validate_layout

    runnable = []
    for schedule in args.schedule_list:
        try:
            trial = _trial(args, schedule)
            if not trial.peer:  # DeepSpeed checks its own layouts (peers/deepspeed.py build)
                validate_layout(trial)
        except (LayoutError, ValueError) as error:  # ValueError: auto found nothing to run
            results[schedule] = {"status": "skipped", "reason": str(error)}
            continue
        runnable.append((schedule, trial))
    return runnable


def run_config(args, name=None, dump_dir=None):
    """Every row of args on this world; returns {"name", "config", "schedules",
    "unique_payload_bytes", "unique_payload_floor_ms"}."""
    results = {}
    runnable = _runnable(args, results)
    device = current_device()
    if runnable:
        set_layout(runnable[0][1])
        runnable = _tune_pending(runnable, results)
    unique_bytes = None
    if runnable:
        weights = full_weights(args)
        replica = Replica(runnable[0][1], weights, device)
        dump_inputs(dump_dir, args, replica, weights)
        unique_bytes = ledger.unique_payload_bytes(runnable[0][1], replica)
        timed, shared = {}, SharedWeights()
        for schedule, trial in runnable:
            try:
                timed[schedule] = (
                    run_peer(schedule, trial, replica, weights, device, dump_dir) if trial.peer
                    else run_schedule(schedule, trial, replica, weights, device, dump_dir,
                                      shared))
            except PeerCannotRun as error:  # raised on every rank alike, before any timing
                results[schedule] = {"status": "skipped", "reason": str(error)}
        check_against_megatron(timed)
        time_schedules(timed, args)
        if args.step_times:
            time_steps(timed, args)
        results.update({schedule: result for schedule, (result, _) in timed.items()})
    ordered = {s: results[s] for s in args.schedule_list}
    unique_ms = row_ratios(ordered, args, unique_bytes)
    return {"name": name, "config": config_summary(args), "schedules": ordered,
            "unique_payload_bytes": unique_bytes, "unique_payload_floor_ms": unique_ms}


def run(args):
    """Every configuration (args, or each entry of --configs): (runs, the --json payload)."""
    import json

    from parm_trainer.bench import flags
    from parm_trainer.compat import cpu, cpu_allocator
    from parm_trainer.progress import Progress

    cpu.apply()
    cpu_allocator.tune()
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if not args.configs:
        runs = [run_config(args, None, args.dump)]
        payload = runs[0]
    else:
        with open(args.configs) as fh:
            entries = json.load(fh)
        runs = []
        progress = Progress(len(entries), "bench_moe_layer configurations",
                            enabled=os.environ.get("RANK", "0") == "0")
        for i, entry in enumerate(entries):
            sub = flags.parse(entry["argv"], world_size=args.world_size)
            name = entry.get("name", str(i))
            dump = os.path.join(args.dump, name) if args.dump else None
            runs.append(run_config(sub, name, dump))
            progress.done(name)
        payload = {"runs": runs}
    ensure_distributed(args)  # every row of every configuration may have been skipped
    return runs, payload
