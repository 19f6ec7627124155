"""What bench_moe_layer reports: the JSON (--json: the config and, per row, status (ok or
skipped, with the reason), times, bytes and differences) and the table, with --step-times' lines.

    emit(runs, payload, args.json)     # rank 0: the tables, then the JSON file
"""

from __future__ import annotations

import json

import torch

from parm_trainer.bench.results import DIFF_KEYS, KINDS, fmt, total_ms
from parm_trainer.bench.weights import router_name

COLUMNS = ("schedule", "fwd ms r0/max", "bwd ms r0/max", "fwd+bwd ms", "ratio", "a2a KiB",
           "ag KiB", "rs KiB", "ar KiB", "node KiB", "floor ms", "x floor", "x uniq", "d out",
           "d in-grad", "d gate", "d expert", "d aux")


def config_summary(args):
    from parm_trainer.bench.layout import device
    from parm_trainer.moe.reference import ACTIVATION

    return {
        "world_size": args.world_size,
        "device": str(device()),
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
        "router": router_name(args),
        "activation": ACTIVATION,
        "beyond_reference": getattr(args, "beyond_reference", []),  # features.py
    }


def row_ratios(ordered: dict, args, unique_bytes):
    """Each row's fwd_bwd_ratio (over --ratio-to's) and link_floor_ms (its node bytes over
    --inter-node-rate); returns the unique payload's floor in ms (None without a rate)."""
    base_total = total_ms(ordered.get(args.ratio_to, {}))
    for result in ordered.values():
        total = total_ms(result)
        result["fwd_bwd_ratio"] = (total / base_total
                                   if total is not None and base_total else None)
        cross = result.get("cross_node_bytes")
        result["link_floor_ms"] = (cross / args.link_bytes_per_s * 1e3
                                   if cross and args.link_bytes_per_s else None)
    return (unique_bytes / args.link_bytes_per_s * 1e3
            if unique_bytes and args.link_bytes_per_s else None)


def _head(run) -> str:
    c = run["config"]
    head = (f"MoE layer: world {c['world_size']} ({c['device']}),"
            f" MP {c['tensor_model_parallel_size']} EP {c['expert_model_parallel_size']}"
            f" ESP {c['expert_tensor_parallel_size']}"
            f" DP {c['data_parallel_size']}{' SP' if c['sequence_parallel'] else ''}; "
            f"E {c['num_experts']} top-{c['moe_router_topk']}"
            f"{' pre-softmax' if c.get('moe_router_pre_softmax') else ''} M {c['hidden_size']}"
            f" H {c['moe_ffn_hidden_size']} S {c['seq_length']} B {c['micro_batch_size']}"
            f" f {c['moe_expert_capacity_factor'] or 'dropless'} chunks {c['moe_parm_chunks']}")
    if c.get("beyond_reference"):
        head += "; " + ", ".join(flag.removeprefix("--") for flag in c["beyond_reference"])
    return f"[{run['name']}] " + head if run.get("name") else head


def _row(name, r, unique_ms) -> tuple:
    if r["status"] != "ok":
        return (name, f"skipped: {r['reason']}")
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
            f"/r{r['chunks']}" + ("/local" if r.get("local_first") else "")
    total = total_ms(r)
    return (name,
            f"{fmt(f and f['rank0'], '.2f')}/{fmt(f and f['max'], '.2f')}",
            f"{fmt(b and b['rank0'], '.2f')}/{fmt(b and b['max'], '.2f')}",
            fmt(total, ".2f"), fmt(r["fwd_bwd_ratio"], ".2f"), *kib,
            fmt(r["cross_node_bytes"] and r["cross_node_bytes"] / 1024, ".1f"),
            fmt(r["link_floor_ms"], ".1f"),
            fmt(r["link_floor_ms"] and total / r["link_floor_ms"], ".2f"),
            fmt(unique_ms and total / unique_ms, ".2f"),
            *(fmt(d[k], ".1e") for k in DIFF_KEYS))


def format_table(run) -> str:
    unique_ms = run.get("unique_payload_floor_ms")
    cols = COLUMNS
    rows = [_row(name, r, unique_ms) for name, r in run["schedules"].items()]
    widths = [max([len(cols[i])] + [len(row[i]) for row in rows
                                     if len(row) == len(cols) or i == 0])
              for i in range(len(cols))]
    lines = [_head(run), "  ".join(col.ljust(w) for col, w in zip(cols, widths))]
    for row in rows:
        if len(row) == 2:
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
        else:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    unique = run.get("unique_payload_bytes")
    lines.append("fwd+bwd ms: one iteration's forward + backward, max over ranks; bytes: sent per "
                 "rank (max over ranks), forward + backward, one iteration; "
                 f"ratio: fwd+bwd / {run['config']['ratio_to']}'s; node KiB: sent off the "
                 "busiest node (forward + backward); floor ms: that over --inter-node-rate; "
                 "x floor: fwd+bwd / floor; x uniq: fwd+bwd / the unique-payload floor ("
                 f"{fmt(unique and unique / 1024, '.1f')}"
                 f" KiB leaving the busiest node, {fmt(unique_ms, '.1f')} ms: each token once "
                 "per remote node of its experts, out and back, forward and backward); "
                 f"d: max abs diff to {_checked_against(run)}")
    return "\n".join(lines)


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
        total = total_ms(r)
        lines.append(f"{name} steps fwd/bwd ms: {steps}")
        lines.append(f"{name} steps sum {timing['steps_total']:.2f} ms = "
                     f"{timing['steps_total'] / timing['fwd_bwd_total']:.3f} x the fwd+bwd of the "
                     f"same iterations ({timing['fwd_bwd_total']:.2f} ms), "
                     f"{timing['steps_total'] / total:.3f} x the row's ({total:.2f} ms, untimed)")
    return "\n".join(lines)


def emit(runs, payload, json_path) -> None:
    """Rank 0 prints every run's table (and step times) and writes the JSON; every rank then
    waits for it at a barrier."""
    if torch.distributed.get_rank() == 0:
        for run in runs:
            print(format_table(run), flush=True)
            steps = format_step_times(run)  # rows timed with --step-times
            if steps:
                print(steps, flush=True)
        if json_path:
            with open(json_path, "w") as fh:
                json.dump(payload, fh, indent=1)
    torch.distributed.barrier()  # rank 0 has written its files


def _checked_against(run) -> str:
    """What the rows' d columns compare with: reference.py, or (flags beyond it, features.py)
    megatron's row."""
    against = {r.get("checked_against") for r in run["schedules"].values()} - {None}
    return f"the {against.pop()} row (output, input grad)" if against else "reference.py"
