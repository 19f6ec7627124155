"""python tools/validate_cost_model.py --nproc 4 --out-dir runs/validate_cost_model

Checks the MoE cost model (parm_trainer/moe/cost_model.py) against measurements on this
machine, in three steps:

1. Calibrate. tools/calibrate_comm.py measures every collective on groups of the layer's group
   size (--group-size, default 2: the MP, EP and ESP groups of the grid's layouts), all groups
   at once, plus the expert MLP's compute rate and the memory rate of token permutation, with
   twice calibrate_comm's default repeats (the choice between s1 and s2 hangs on differences
   of a few alphas), and writes OUT/profile_calibrated.json. (--profile PATH skips this and uses PATH.)
2. Measure. One launch of tools/bench_moe_layer.py runs baseline, s1 and s2 forward + backward
   on every configuration of the grid (grid(): tokens, hidden, ffn, experts, top-k, capacity
   factor, MP/EP/ESP and sequence parallelism on 4 ranks), each checked against the single-
   process reference, and writes OUT/bench_0.json; the schedules' iterations interleave.
   --rounds (default 3) repeats it, every other round in reverse order, and the times are
   averaged: on this noisy machine one round's s1-s2 order flipped in about one configuration
   in five when the schedules were timed one after another.
3. Fit and validate. The isolated alpha-beta and FLOP prices leave out how collectives,
   compute and the framework's own host work slow each other down on a shared machine. Four
   whole-layer terms (the profile's "layer" entry: a factor on the collectives' time, a factor
   on the compute's, a host cost per plan step and a cost per collective call) are fitted by
   non-negative least squares, and validated by two-fold cross-validation: the grid's
   configurations of each layout are dealt alternately into two halves, and each half is
   predicted by the terms fitted on the other, so every configuration is held out once and
   each fit sees every layout measured more than once. For each one and each
   schedule the tool prints the predicted and the measured forward + backward time, and
   whether auto's choice (the cheaper of s1 and s2 by the model) is the measured-faster of
   the two. The terms fitted on all configurations are written with the calibrated numbers
   into OUT/profile.json (load it with --moe-parm-cost-profile).

Summary (printed last and in OUT/validation.json): the median absolute relative error of
predicted against measured time over the held-out runs and schedules; among the held-out
configurations where the faster of s1 and s2 beats the other by more than 5%, the share where
auto chose it; with --chunks, the model's chunk count r against the fastest measured r.
OUT/validation.png plots predicted against measured. The grid, the fit and the scores are in
parm_trainer/bench/ (validation.py, cost_fit.py, validation_report.py).

--nodes N spreads the ranks over N emulated nodes (tools/emulated_cluster.py, as root) with
--inter-node-bandwidth between them: calibration then fits intra- and inter-node collectives
separately; the grid's layouts grow EP with the world (a world of 8 doubles EP) and keep those
whose MP groups fit in a node (node_layouts), so that most of their EP groups cross the shaped
link; its layers are large enough for the link to set their time (NODE_SHAPES), and s1 and s2
are measured at --chunks too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from parm_trainer.process_exit import end
from parm_trainer.bench.validation import (LAYOUTS, NODE_SHAPES, base_name, config_argv,
                                           evaluate, grid, merge_rounds, node_layouts)
from parm_trainer.bench.validation_report import format_report, write_png
from parm_trainer.cluster.launch import add_node_flags, launch_command
from parm_trainer.moe.cost_profile import Profile
from parm_trainer.progress import Progress

TOOLS = os.path.dirname(os.path.abspath(__file__))


def _tool(args, script: str, *tool_args) -> list:
    """The command line that runs a tool on --nproc ranks: on this machine, or across
    --nodes emulated nodes (tools/emulated_cluster.py) with the tool as every rank."""
    return launch_command(args.nproc, args.nodes, args.inter_node_bandwidth,
                          os.path.join(args.out_dir, "nodes"),
                          [os.path.join(TOOLS, script), *tool_args])


def _run(command: list, what: str) -> None:
    print(f"$ {' '.join(command)}", flush=True)
    status = subprocess.call(command)
    if status:
        raise SystemExit(f"validate_cost_model: {what} failed (exit status {status})")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="ranks on this machine")
    p.add_argument("--out-dir", default="runs/validate_cost_model")
    p.add_argument("--profile", default=None,
                   help="a calibrated profile to use instead of calibrating first")
    p.add_argument("--group-size", type=int, default=2,
                   help="calibrate collectives on groups of this many ranks")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per schedule")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3,
                   help="measure the grid this many times (alternating order), averaged")
    p.add_argument("--bench-json", default=None,
                   help="re-score earlier OUT/bench_*.json (comma-separated) instead of "
                        "measuring again")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N configurations of the grid (a quick look)")
    p.add_argument("--chunks", default=None,
                   help="comma-separated chunk counts r > 1 at which s1 and s2 are measured "
                        "too, on every configuration (default: none on one node; 2,4,8 with "
                        "--nodes, where the pipeline is what runs)")
    add_node_flags(p)
    args = p.parse_args(argv)
    if args.nodes < 1 or args.nproc % args.nodes:
        p.error(f"--nproc {args.nproc} must be a multiple of --nodes {args.nodes}")
    if args.chunks is None:
        args.chunks = "2,4,8" if args.nodes > 1 else ""
    try:
        args.chunks = [int(r) for r in args.chunks.split(",") if r.strip()]
    except ValueError:
        p.error(f"--chunks {args.chunks!r}: expected comma-separated integers")
    if any(r < 2 for r in args.chunks):
        p.error(f"--chunks {args.chunks}: each chunk count must be at least 2")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    out = lambda name: os.path.join(args.out_dir, name)  # noqa: E731
    profile_path = args.profile or out("profile_calibrated.json")
    if not args.profile:
        timing = ["--repeats", "15", "--calls", "8"]
        if args.nodes > 1:  # smaller messages and fewer calls: the shaped link is slow
            timing = ["--repeats", "7", "--calls", "2", "--sizes",
                      ",".join(str(65536 << i) for i in range(6))]
        _run(_tool(args, "calibrate_comm.py", "--group-size", str(args.group_size), *timing,
                   "--output", profile_path), "calibration")
    profile = Profile.from_json(profile_path)

    if args.nodes > 1:  # two layouts per shape: the shaped link makes every layer slow
        layouts = node_layouts(args.nproc // args.nodes, args.nproc)
        configs = grid(layouts, NODE_SHAPES, 2)[:args.limit]
    else:
        layouts = LAYOUTS
        configs = grid()[:args.limit]
    names = [f"c{i:02d}" for i in range(len(configs))]
    entries = [(n, config_argv(*c)) for n, c in zip(names, configs)]
    entries += [(f"{n}r{r}", config_argv(*c, r)) for n, c in zip(names, configs)
                for r in args.chunks]
    if args.bench_json:
        rounds = args.bench_json.split(",")
    else:
        timing = ["--iters", str(args.iters), "--warmup", str(args.warmup)]
        # grouped by layout: each change of layout rebuilds the process groups
        layout_of = dict(zip(names, (layout for layout, _ in configs)))
        ordered = sorted(entries, key=lambda e: layouts.index(layout_of[base_name(e[0])]))
        rounds = []
        progress = Progress(args.rounds, "validate_cost_model rounds")
        for r in range(args.rounds):
            # every other round in the opposite order, so a drift of the machine's speed
            # during the run does not favour the schedules or configurations measured first
            entries = ordered if r % 2 == 0 else ordered[::-1]
            with open(out(f"configs_{r}.json"), "w") as f:
                json.dump([{"name": n, "argv": argv + timing} for n, argv in entries],
                          f, indent=1)
            rounds.append(out(f"bench_{r}.json"))
            _run(_tool(args, "bench_moe_layer.py", "--configs", out(f"configs_{r}.json"),
                       "--json", rounds[-1]), f"bench_moe_layer round {r + 1}")
            progress.done(f"round {r + 1} ({len(entries)} configurations)")
    runs = merge_rounds(rounds)

    try:
        result = evaluate(runs, profile)
    except ValueError as error:  # too few configurations to fit (a small --limit)
        raise SystemExit(f"validate_cost_model: {error}") from None
    result["profile"].to_json(out("profile.json"))
    print(format_report(result))
    with open(out("validation.json"), "w") as f:
        json.dump({"summary": result["summary"], "configs": result["configs"],
                   "depths": result["depths"], "profile": json.loads(result["profile"].to_json())}, f, indent=1)
    print(f"wrote {out('validation.json')}, {out('profile.json')} (fitted profile), "
          f"{write_png(result, out('validation.png'))}")
    return 0


if __name__ == "__main__":
    end(main())
