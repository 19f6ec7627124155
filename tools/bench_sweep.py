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
over the best megatron dispatcher's, and which row wins where. The grid and the summary are
parm_trainer/bench/sweep.py.

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
import subprocess
import sys

from parm_trainer.process_exit import end
from parm_trainer.bench.sweep import ROWS, grid, markdown, plots, summarise
from parm_trainer.cluster.launch import add_node_flags, launch_command

TOOLS = os.path.dirname(os.path.abspath(__file__))


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


def measure(args) -> list:
    """One bench_moe_layer launch per world; the paths of their JSON (None if one failed)."""
    paths = []
    timing = ["--iters", str(args.iters), "--warmup", str(args.warmup), "--schedules",
              ",".join(ROWS), "--moe-parm-chunks", "0"]
    if args.nodes > 1:  # per entry: bench_moe_layer parses every entry's argv alone
        timing += ["--inter-node-rate", args.inter_node_bandwidth]
    total = sum(1 for _, w, _ in grid() if w in args.world_list)
    print(f"bench_sweep: {total} configurations x {len(ROWS)} rows in {len(args.world_list)} "
          f"launches (about 3 minutes on a 2-core machine at the defaults; each launch shows "
          f"its ETA)", flush=True)
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
            print(f"bench_sweep: the {world}-rank launch failed (exit {status})", file=sys.stderr)
            return None
    return paths


def main(argv=None) -> int:
    args = parse(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    paths = args.bench_json.split(",") if args.bench_json else measure(args)
    if paths is None:
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
    end(main())
