"""python tools/bench_sweep.py --out-dir runs/bench_sweep [--worlds 2,4,8] [--iters 5] [--nodes 2]

A grid of MoE layer configurations (tokens, hidden, experts, top-k, capacity factor, MP/EP/ESP
on 2, 4 and 8 ranks) through tools/bench_moe_layer.py, one launch per world size, every row
of every configuration checked against the reference there. Rows: Parm's baseline, s1, s2
and auto (the cost model's pick, pipeline depth included), megatron-core's alltoall and
allgather dispatchers, DeepSpeed's ep, dedup and ted modes (with `pip install .[peers]`); a
row that cannot run a layout says why. Layouts with MP > 1 use sequence parallelism (megatron
needs it; Parm runs either way).

Writes OUT/sweep.json (every run), OUT/sweep.md (forward + backward ms per row, normalised to
deepspeed-ted where it ran), OUT/time.png (the same, per configuration) and OUT/bytes.png
(bytes sent per rank by collective kind, Parm's rows), and prints, over the configurations
where they ran, min / median / max of the best Parm schedule's time over deepspeed-ted's and
over the best megatron dispatcher's, and which row wins where.

With --nodes N (as root: tools/emulated_cluster.py) each world's launch runs on N emulated
nodes of world / N ranks each, --inter-node-bandwidth (200mbit) between them; every world of
--worlds must be a multiple of N (one rank per node at the least), else the sweep is refused
before anything starts. bench_moe_layer then gets --inter-node-rate, so the rows whose
collectives it sees (baseline and Parm's) carry their link floor: the bytes leaving the
busiest node over the link rate. sweep.md adds per configuration the best Parm row's floor and
its time over it, and the summary min / median / max of that ratio; on one node these show -.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

from emulated_cluster import add_node_flags, launch_command  # noqa: E402

PARM = ("s1", "s2", "auto")
MEGATRON = ("megatron-alltoall", "megatron-allgather")
ROWS = ("baseline", *PARM, *MEGATRON, "deepspeed-ep", "deepspeed-dedup", "deepspeed-ted")
KINDS = ("alltoall", "allgather", "reducescatter", "allreduce")

# (world, MP, EP, ESP) and (tokens per MP group as seq x micro-batch, hidden, ffn, experts,
# top-k, capacity factor or None).
LAYOUTS = [(2, 2, 1, 2), (2, 2, 2, 1), (4, 2, 2, 2), (4, 2, 2, 1), (4, 4, 1, 4), (4, 1, 4, 1),
           (8, 2, 4, 2), (8, 4, 2, 4)]
SHAPES = [((128, 4), 128, 256, 4, 2, None), ((256, 4), 256, 512, 8, 2, None),
          ((128, 8), 128, 512, 8, 3, None), ((256, 2), 256, 256, 4, 2, 1.0)]


def grid() -> list:
    """(name, world, argv) for every layout x shape: 32 configurations."""
    out = []
    for world, mp, ep, esp in LAYOUTS:
        for (seq, mbs), hidden, ffn, experts, topk, factor in SHAPES:
            argv = ["--tensor-model-parallel-size", str(mp), "--expert-model-parallel-size",
                    str(ep), "--expert-tensor-parallel-size", str(esp), "--seq-length", str(seq),
                    "--micro-batch-size", str(mbs), "--hidden-size", str(hidden),
                    "--moe-ffn-hidden-size", str(ffn), "--num-experts", str(experts),
                    "--moe-router-topk", str(topk), "--num-attention-heads", "4"]
            if factor is not None:
                argv += ["--moe-expert-capacity-factor", str(factor)]
            if mp > 1:
                argv.append("--sequence-parallel")
            name = (f"w{world}-mp{mp}ep{ep}esp{esp}-n{seq * mbs}-m{hidden}-e{experts}k{topk}"
                    f"{'-f' + str(factor) if factor else ''}")
            out.append((name, world, argv))
    return out


def total_ms(row):
    if not row or row.get("status") != "ok":
        return None
    return row["total_ms"]["max"]


def summarise(runs: list) -> dict:
    """Per configuration: the best Parm row, its time over deepspeed-ted's, over the best
    megatron dispatcher's and over its link floor, and the fastest row; then min / median /
    max of the three ratios. The floor is the best Parm row's own link_floor_ms (its bytes
    leaving the busiest node over the link rate; None on one node), not the smallest of the
    Parm rows': each schedule sends its own bytes, so a floor bounds only its own row's time,
    and the ratio is that row's "x floor" in bench_moe_layer's table."""
    rows, to_ted, to_megatron, to_floor = [], [], [], []
    for run in runs:
        times = {name: total_ms(run["schedules"].get(name)) for name in ROWS}
        ok = {name: t for name, t in times.items() if t is not None}
        parm = {n: ok[n] for n in PARM if n in ok}
        best_parm = min(parm, key=parm.get) if parm else None
        megatron = [ok[n] for n in MEGATRON if n in ok]
        floor = run["schedules"][best_parm].get("link_floor_ms") if best_parm else None
        row = {"name": run["name"], "times": times, "best_parm": best_parm,
               "fastest": min(ok, key=ok.get) if ok else None,
               "parm_over_ted": parm[best_parm] / ok["deepspeed-ted"]
               if best_parm and "deepspeed-ted" in ok else None,
               "parm_over_megatron": parm[best_parm] / min(megatron)
               if best_parm and megatron else None,
               "floor_ms": floor, "parm_over_floor": parm[best_parm] / floor if floor else None}
        rows.append(row)
        if row["parm_over_ted"] is not None:
            to_ted.append(row["parm_over_ted"])
        if row["parm_over_megatron"] is not None:
            to_megatron.append(row["parm_over_megatron"])
        if row["parm_over_floor"] is not None:
            to_floor.append(row["parm_over_floor"])

    def spread(values):
        return None if not values else {"min": min(values), "median": statistics.median(values),
                                        "max": max(values), "configs": len(values)}

    wins = {}
    for row in rows:
        if row["fastest"]:
            wins[row["fastest"]] = wins.get(row["fastest"], 0) + 1
    return {"configs": rows, "parm_over_ted": spread(to_ted),
            "parm_over_megatron": spread(to_megatron), "parm_over_floor": spread(to_floor),
            "fastest_counts": wins}


def markdown(summary: dict) -> str:
    head = ("| configuration | " + " | ".join(ROWS) +
            " | best Parm / ted | best Parm / megatron | floor ms | best Parm / floor |")
    lines = [head, "|" + "---|" * (len(ROWS) + 5)]
    for row in summary["configs"]:
        ted = row["times"].get("deepspeed-ted")
        cells = []
        for name in ROWS:
            t = row["times"][name]
            cells.append("-" if t is None else f"{t:.1f}" + (f" ({t / ted:.2f})" if ted else ""))
        fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
        lines.append(f"| {row['name']} | " + " | ".join(cells) +
                     f" | {fmt(row['parm_over_ted'])} | {fmt(row['parm_over_megatron'])} |"
                     f" {fmt(row['floor_ms'], '.1f')} | {fmt(row['parm_over_floor'])} |")
    lines.append("")
    lines.append("forward + backward ms (max over ranks), in brackets over deepspeed-ted's; "
                 "- : the row cannot run the layout (sweep.json says why) or is not installed; "
                 "floor ms: the best Parm row's bytes leaving the busiest node over "
                 "--inter-node-bandwidth (- on one node)")
    return "\n".join(lines)


def plots(runs: list, summary: dict, out_dir: str) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [row["name"] for row in summary["configs"]]
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.45), 5))
    width = 0.8 / len(ROWS)
    for i, schedule in enumerate(ROWS):
        values = []
        for row in summary["configs"]:
            t, ted = row["times"][schedule], row["times"]["deepspeed-ted"]
            values.append(t / ted if t is not None and ted else np.nan)
        ax.bar(np.arange(len(names)) + i * width, values, width, label=schedule)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(names)) + 0.4, names, rotation=90, fontsize=6)
    ax.set_ylabel("fwd + bwd time / deepspeed-ted's")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    paths = [os.path.join(out_dir, "time.png")]
    fig.savefig(paths[0])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.45), 5))
    parm_rows = ("baseline", "s1", "s2")
    width = 0.8 / len(parm_rows)
    for i, schedule in enumerate(parm_rows):
        bottom = np.zeros(len(runs))
        for kind in KINDS:
            values = []
            for run in runs:
                b = run["schedules"].get(schedule, {}).get("bytes")
                values.append(0 if not b else max(f + w for f, w in zip(b["forward"][kind],
                                                                         b["backward"][kind])))
            values = np.array(values) / 2 ** 20
            ax.bar(np.arange(len(runs)) + i * width, values, width, bottom=bottom,
                   label=f"{schedule} {kind}" if i == 0 or kind == KINDS[0] else None)
            bottom += values
    ax.set_xticks(np.arange(len(names)) + 0.4, names, rotation=90, fontsize=6)
    ax.set_ylabel("MiB sent per rank (max), fwd + bwd; bars: baseline, s1, s2")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bytes.png"))
    fig.savefig(paths[1])
    plt.close(fig)
    return paths


def bench_command(args, world: int, config_path: str, json_path: str) -> list:
    """bench_moe_layer on `world` ranks: on this machine, or with --nodes > 1 on that many
    emulated nodes (world / nodes ranks each, logs in OUT/nodes_w<world>)."""
    return launch_command(world, args.nodes, args.inter_node_bandwidth,
                          os.path.join(args.out_dir, f"nodes_w{world}"),
                          [os.path.join(TOOLS, "bench_moe_layer.py"), "--configs", config_path,
                           "--json", json_path])


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="runs/bench_sweep")
    p.add_argument("--worlds", default="2,4,8", help="world sizes of the grid to run")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--bench-json", default=None,
                   help="re-summarise earlier OUT/bench_w*.json (comma-separated) instead")
    add_node_flags(p)
    args = p.parse_args(argv)
    args.world_list = [int(w) for w in args.worlds.split(",")]
    if args.nodes < 1 or any(w % args.nodes for w in args.world_list):
        p.error(f"--nodes {args.nodes}: every world of --worlds {args.worlds} must be a positive "
                "multiple of it (world / nodes ranks on each node, one at the least)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    paths = args.bench_json.split(",") if args.bench_json else []
    if not paths:
        timing = ["--iters", str(args.iters), "--warmup", str(args.warmup), "--schedules",
                  ",".join(ROWS), "--moe-parm-chunks", "0"]
        if args.nodes > 1:  # per entry: bench_moe_layer parses every entry's argv alone
            timing += ["--inter-node-rate", args.inter_node_bandwidth]
        for world in args.world_list:
            entries = [{"name": n, "argv": argv + timing} for n, w, argv in grid() if w == world]
            # absolute: on emulated nodes the ranks run in the repository root (launch.sh)
            config_path = os.path.abspath(os.path.join(args.out_dir, f"configs_w{world}.json"))
            with open(config_path, "w") as f:
                json.dump(entries, f, indent=1)
            paths.append(os.path.abspath(os.path.join(args.out_dir, f"bench_w{world}.json")))
            command = bench_command(args, world, config_path, paths[-1])
            print(f"$ {' '.join(command)}", flush=True)
            status = subprocess.call(command, stdout=subprocess.DEVNULL)
            if status:
                print(f"bench_sweep: the {world}-rank launch failed (exit {status})",
                      file=sys.stderr)
                return 1
    runs = []
    for path in paths:
        with open(path) as f:
            runs += json.load(f)["runs"]
    summary = summarise(runs)
    with open(os.path.join(args.out_dir, "sweep.json"), "w") as f:
        json.dump({"summary": summary, "runs": runs}, f, indent=1)
    with open(os.path.join(args.out_dir, "sweep.md"), "w") as f:
        f.write(markdown(summary) + "\n")
    pngs = plots(runs, summary, args.out_dir)
    ratios = [("parm_over_ted", "deepspeed-ted"),
              ("parm_over_megatron", "the best megatron dispatcher")]
    if summary["parm_over_floor"]:
        ratios.append(("parm_over_floor", "link floor"))
    for key, label in ratios:
        s = summary[key]
        print(f"best Parm schedule / {label}: " + ("no configuration" if s is None else
              f"min {s['min']:.2f}, median {s['median']:.2f}, max {s['max']:.2f} over "
              f"{s['configs']} configurations"))
    print("fastest row: " + ", ".join(f"{k} {v}" for k, v in
                                      sorted(summary["fastest_counts"].items(), key=lambda kv: -kv[1])))
    print(f"wrote {os.path.join(args.out_dir, 'sweep.json')}, sweep.md, {', '.join(pngs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
