"""python tools/simulate_cluster.py --cluster a100-nvlink-8x --json sim.json

Parm's schedules priced on paper, past this machine: every MoE layer configuration of a grid
like the paper's (micro-batch x seq tokens, hidden, FFN ratio, experts, top-k, capacity factor,
MP/EP/ESP layouts on 8 and 32 GPUs) goes through parm_trainer.moe.cost_model with a cluster
profile, and the tool prints the modelled speedup of s1, s2 and auto (the cheaper of the two,
as --moe-parm-schedule auto would choose) over the baseline (DeepSpeed-MoE TED): min, median,
max, and where each schedule wins (by MP size, by tokens per MP group).

--cluster: a profile JSON file (Profile.from_json's format) or a built-in name, a file of
tools/clusters/: a100-nvlink-8x (8 NVLink A100 per node, 200 Gb/s per GPU between nodes) or
pcie-4x (4 PCIe GPUs per node, 100 Gb/s per node). Their numbers are assumptions, stated in
the files; calibrate your own. --layouts takes GPUS:MP[:EP[:ESP]] items (ESP defaults to MP,
EP to GPUS/ESP); each layout is placed on the cluster's nodes in megatron's rank order. A
configuration a schedule cannot run (capacity not divisible by MP for s2, experts not by EP)
counts for the others only. --chunks defaults to --moe-parm-chunks' default, 1.

--what-if adds "s2spec", what the executor does not do yet: capacity padded to a multiple of MP
instead of refused, and the backward MP AllGather (of split_capacity) hidden behind the backward
exchange (max instead of sum: an optimistic bound; the forward one already follows each
piece's AlltoAll back); "autospec" is the cheaper of s1 and s2spec.

Speedup = baseline seconds / schedule seconds, forward + backward of one MoE layer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from dataclasses import replace

from parm_trainer.process_exit import end
from parm_trainer.moe.cost_model import plan_cost, price_schedules
from parm_trainer.moe.cost_profile import Profile
from parm_trainer.moe.cost_shape import LayerShape
from parm_trainer.moe.schedules import build_plan

CLUSTERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clusters")
SCHEDULES = ("baseline", "s1", "s2")


def _ints(text):
    return [int(v) for v in text.split(",")]


def _factors(text):
    return [None if v.strip().lower() in ("none", "dropless") else float(v)
            for v in text.split(",")]


def _layouts(text):
    out = []
    for item in text.split(","):
        parts = [int(v) for v in item.split(":")]
        gpus, mp = parts[0], parts[1]
        esp = parts[3] if len(parts) > 3 else mp
        ep = parts[2] if len(parts) > 2 else gpus // esp
        out.append((gpus, mp, ep, esp))
    return out


def parse_args(argv=None):
    class Formatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=Formatter)
    p.add_argument("--cluster", default="a100-nvlink-8x",
                   help="profile JSON file, or a built-in: " + ", ".join(
                       sorted(f[:-5] for f in os.listdir(CLUSTERS) if f.endswith(".json"))))
    p.add_argument("--batch", type=_ints, default=[4, 16], help="micro-batch sizes")
    p.add_argument("--seq", type=_ints, default=[512, 1024, 2048], help="sequence lengths")
    p.add_argument("--hidden", type=_ints, default=[1024, 2048, 4096], help="hidden sizes M")
    p.add_argument("--ffn-ratio", type=_ints, default=[2, 4], help="expert FFN hidden / hidden")
    p.add_argument("--experts", type=_ints, default=[8, 16, 32], help="experts E")
    p.add_argument("--topk", type=_ints, default=[1, 2], help="top-k")
    p.add_argument("--capacity-factor", type=_factors, default=[1.0, 1.2],
                   help="comma list; 'none' = dropless (balanced routing assumed)")
    p.add_argument("--layouts", type=_layouts, default=_layouts("8:2,8:4,32:8"),
                   help="GPUS:MP[:EP[:ESP]] list")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--chunks", type=int, default=1, help="pieces r of the expert exchange")
    p.add_argument("--bytes-per-element", type=int, default=2, help="2: bf16")
    p.add_argument("--what-if", action="store_true",
                   help="also price an S2 with padded capacity and a hidden backward gather")
    p.add_argument("--json", help="write every configuration's predictions here")
    p.add_argument("--png", help="histogram of the speedups (needs matplotlib)")
    return p.parse_args(argv)


def load_cluster(name):
    path = name if os.path.exists(name) else os.path.join(CLUSTERS, f"{name}.json")
    if not os.path.exists(path):
        raise SystemExit(f"--cluster {name}: no such file, nor a built-in in {CLUSTERS}")
    return Profile.from_json(path)


def grid(args):
    for (gpus, mp, ep, esp), b, s, m, ratio, e, k, f in itertools.product(
            args.layouts, args.batch, args.seq, args.hidden, args.ffn_ratio, args.experts,
            args.topk, args.capacity_factor):
        if e % ep == 0 and k <= e:
            yield {"gpus": gpus, "batch": b, "seq": s}, LayerShape(
                tokens=b * s, hidden=m, ffn=ratio * m, experts=e, topk=k, capacity_factor=f,
                bytes_per_element=args.bytes_per_element, mp=mp, ep=ep, esp=esp,
                sequence_parallel=args.sequence_parallel, chunks=args.chunks, dp=gpus // mp)


def s2_as_specified(shape, profile):
    """S2 with padded capacity and the backward MP AllGather (of split_capacity) hidden behind
    the backward exchange: priced max(exchange, gather) rather than the sum (an optimistic
    bound)."""
    cost = plan_cost(build_plan("s2", shape.sequence_parallel),
                     replace(shape, pad_capacity=True), profile)
    step = {row["step"].split("[")[0]: row for row in cost["steps"]}
    hidden = min(step["split_capacity"]["backward_s"], step["exchange"]["backward_s"])
    return cost["total_s"] - hidden


def simulate(args, profile):
    rows = []
    for extra, shape in grid(args):
        seconds = price_schedules(shape, profile, SCHEDULES)
        runnable = {n: t for n, t in seconds.items() if n != "baseline" and t is not None}
        auto = min(runnable, key=runnable.get) if runnable else None
        base = seconds["baseline"]
        speedup = {n: (base / seconds[n] if base and seconds[n] else None) for n in ("s1", "s2")}
        speedup["auto"] = base / runnable[auto] if base and auto else None
        if args.what_if:
            try:
                seconds["s2spec"] = s2_as_specified(shape, profile)
            except ValueError:
                seconds["s2spec"] = None
            spec = [t for t in (seconds["s1"], seconds["s2spec"]) if t is not None]
            speedup["s2spec"] = base / seconds["s2spec"] if base and seconds["s2spec"] else None
            speedup["autospec"] = base / min(spec) if base and spec else None
        rows.append({**extra, "tokens": shape.tokens, "hidden": shape.hidden, "ffn": shape.ffn,
                     "experts": shape.experts, "topk": shape.topk,
                     "capacity_factor": shape.capacity_factor, "mp": shape.mp, "ep": shape.ep,
                     "esp": shape.esp, "sequence_parallel": shape.sequence_parallel,
                     "chunks": shape.chunks, "seconds": seconds, "auto": auto,
                     "speedup": speedup})
    return rows


def _wins_table(rows, key, label):
    lines = [f"  {label:>8} {'configs':>8} {'s1':>6} {'s2':>6} {'s2 n/a':>7} {'base<auto':>10}"
             f" {'auto median':>12}"]
    for value in sorted({r[key] for r in rows}):
        group = [r for r in rows if r[key] == value]
        count = {n: sum(r["auto"] == n for r in group) for n in ("s1", "s2")}
        no_s2 = sum(r["seconds"]["s2"] is None for r in group)
        base_better = sum(1 for r in group if r["speedup"]["auto"] is not None
                          and r["speedup"]["auto"] < 1)
        speedups = [r["speedup"]["auto"] for r in group if r["speedup"]["auto"] is not None]
        median = f"{statistics.median(speedups):12.2f}" if speedups else f"{'-':>12}"
        lines.append(f"  {value:>8} {len(group):>8} {count['s1']:>6} {count['s2']:>6} "
                     f"{no_s2:>7} {base_better:>10} {median}")
    return lines


def report(rows, profile, args):
    layouts = ",".join(f"{g}:{m}:{e}:{s}" for g, m, e, s in args.layouts)
    lines = [f"cluster {profile.name}: {profile.description}",
             f"{len(rows)} configurations, layouts GPUS:MP:EP:ESP {layouts}, chunks "
             f"{args.chunks}, sequence parallel {'on' if args.sequence_parallel else 'off'}",
             "modelled speedup over the baseline (forward + backward of one MoE layer):",
             f"  {'':>8} {'configs':>8} {'min':>7} {'median':>7} {'max':>7}"]
    names = ("s1", "s2", "auto") + (("s2spec", "autospec") if args.what_if else ())
    for name in names:
        values = [r["speedup"][name] for r in rows if r["speedup"][name] is not None]
        if values:
            lines.append(f"  {name:>8} {len(values):>8} {min(values):7.2f} "
                         f"{statistics.median(values):7.2f} {max(values):7.2f}")
        else:
            lines.append(f"  {name:>8} {0:>8}       -       -       -")
    if args.what_if:
        wins = sum(1 for r in rows if r["seconds"]["s2spec"] is not None
                   and r["seconds"]["s2spec"] < r["seconds"]["s1"])
        lines.append(f"  s2spec cheaper than s1 in {wins} of {len(rows)} configurations")
    lines.append("auto's choice by MP size (s2 n/a: s2 cannot run; base<auto: baseline cheaper):")
    lines += _wins_table(rows, "mp", "MP")
    lines.append("auto's choice by tokens per MP group (micro-batch x seq):")
    lines += _wins_table(rows, "tokens", "tokens")
    return "\n".join(lines)


def write_png(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--png {path} skipped: matplotlib is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("s1", "s2", "auto"):
        values = [r["speedup"][name] for r in rows if r["speedup"][name] is not None]
        ax.hist(values, bins=40, alpha=0.5, label=name)
    ax.set_xlabel("modelled speedup over baseline")
    ax.set_ylabel("configurations")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return f"histogram written to {path}"


def main(argv=None):
    args = parse_args(argv)
    profile = load_cluster(args.cluster)
    rows = simulate(args, profile)
    if not rows:
        raise SystemExit("the grid is empty (experts not divisible by EP everywhere?)")
    print(report(rows, profile, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster": json.loads(profile.to_json()), "configs": rows}, f, indent=1)
        print(f"predictions written to {args.json}")
    if args.png:
        print(write_png(rows, args.png))
    return rows


if __name__ == "__main__":
    end(main())
