"""python tools/bench_e2e.py --nproc 4 --schedules baseline,s1,s2,auto,megatron --runs 3

Rows: a --moe-parm-schedule name; "default" (no Parm flag: auto, the depth chosen at start-up);
"s1/r2" (a schedule at a pipeline depth; "s1/r2/local" with --moe-parm-local-first);
"megatron-alltoall", "megatron-allgather" (megatron's own MoE layer with that token
dispatcher); any of them with "@flag=value" or "@flag" appended
for flags of that row alone ("s1/r1,s1/r1@timing-log-level=2": what the timers cost).

Training speed of pretrain_gpt_moe.py under each MoE schedule, end to end: `make demo`'s MoE
GPT (4 layers, hidden 128, Mixtral-shaped: RMSNorm, SwiGLU, RoPE, no dropout; 4 experts, top-2,
sequence 128, TP2 x EP2 x ESP2 with sequence parallelism on 4 ranks) on the same data with the same seed, --train-iters
iterations per run. The runs alternate (schedule A, B, C, then A, B, C again, ...) so that a
change of the machine's speed touches every schedule alike, and each schedule's figure is the
median over its --runs runs of the mean ms/iter of the logged intervals after the first (the
first holds the start-up). tokens/s = global batch x sequence / (ms/iter).

--save-interval N: every run saves every N iterations into a directory of its own (removed
after the run); "wall ms/iter" then shows what the saves cost ("ms/iter" leaves them out, as
the training log does): the time between the arrival of the first and the last logged
iteration lines over the iterations between them, everything included; "held s" is the mean
time training waited per save (`saved checkpoint ... in X s`; with --async-save the start and
the finalisation, `training waited X s`). "s1/r1,s1/r1@async-save": synchronous against
background saves. Each row's "x first" is its wall ms/iter over the first row's.

--nodes N runs every launch across N emulated nodes (tools/emulated_cluster.py, as root) with
--inter-node-bandwidth between them. Extra flags after -- go to pretrain_gpt_moe.py, last.
Writes --json (every run's figures) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time

from parm_trainer.process_exit import end
from parm_trainer.bench.flags import depth_row
from parm_trainer.bench.training_runs import (DEMO_MODEL, add_run_flags, intervals,
                                             parse_run_flags, run_figure, run_timed, save_held,
                                             training_log, wall_figure)
from parm_trainer.cluster.launch import add_node_flags, launch_command
from parm_trainer.progress import Progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = DEMO_MODEL


def schedule_flags(name: str) -> list:
    """A row's flags: "default" none (auto, depth chosen at start-up); "megatron-alltoall" and
    "megatron-allgather" megatron's layer with that dispatcher; "s1/r2" a schedule at a depth
    ("s1/r2/local": with --moe-parm-local-first); any other name --moe-parm-schedule NAME.
    Each "@flag=value" or "@flag" after the name adds --flag [value] to that row alone
    ("default@timing-log-level=2": the default at level 2)."""
    name, *added = name.split("@")
    extra = []
    for flag in added:
        key, _, value = flag.partition("=")
        extra += [f"--{key}"] + ([value] if value else [])
    return _row_flags(name) + extra


def _row_flags(name: str) -> list:
    if name == "default":
        return []
    if name.startswith("megatron-"):
        return ["--moe-parm-schedule", "megatron", "--moe-token-dispatcher-type",
                name.split("-", 1)[1]]
    depth = depth_row(name)  # bench_moe_layer's row names: s1/r2, s1/r2/local
    if depth is None:
        return ["--moe-parm-schedule", name]
    schedule, chunks, local = depth
    return (["--moe-parm-schedule", schedule, "--moe-parm-chunks", str(chunks)]
            + (["--moe-parm-local-first"] if local else []))


CHOSEN = re.compile(r"using (s[12])(?: with --moe-parm-chunks (\d+))?( --moe-parm-local-first)?")


def chosen_row(output: str):
    """auto's choice as a row name ("s1/r2", "s1/r2/local"), from its log line; None without."""
    found = CHOSEN.search(output)
    if found is None:
        return None
    name, depth, local = found.groups()
    return name + (f"/r{depth}" if depth else "") + ("/local" if local else "")


def command(args, schedule: str, run_dir: str) -> list:
    flags = ["--tensor-model-parallel-size", str(args.tp), "--expert-model-parallel-size",
             str(args.ep), "--expert-tensor-parallel-size", str(args.tp), *MODEL,
             "--train-iters", str(args.train_iters), "--log-interval", str(args.log_interval),
             "--eval-interval", str(args.train_iters + 1), "--data-path", args.data_path,
             "--tokenizer-model", args.tokenizer_model, "--data-cache-path",
             os.path.join(run_dir, "data_cache"), *schedule_flags(schedule)]
    if args.tp > 1:
        flags.append("--sequence-parallel")
    if args.save_interval:
        flags += ["--save", os.path.join(run_dir, "checkpoints"), "--save-interval",
                  str(args.save_interval)]
    flags += args.extra
    return launch_command(args.nproc, args.nodes, args.inter_node_bandwidth,
                          os.path.join(run_dir, "nodes"), ["pretrain_gpt_moe.py", *flags])


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--tp", type=int, default=2, help="MP = ESP")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--schedules", default="baseline,s1,s2,auto,megatron")
    p.add_argument("--runs", type=int, default=3, help="runs per schedule (median)")
    p.add_argument("--train-iters", type=int, default=40)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--save-interval", type=int, default=0,
                   help="save every N iterations (each run into its own directory)")
    add_node_flags(p)
    add_run_flags(p, "bench_e2e")
    args = parse_run_flags(p, argv, ROOT)
    args.schedule_list = [s for s in args.schedules.split(",") if s]
    if args.nproc % args.nodes:
        p.error("--nproc must be a multiple of --nodes")
    return args


def _summary(runs: dict, saves: bool) -> dict:
    """Median figures per row, printed as a table (with saves: wall ms/iter, held s, x first)."""
    width = max([18] + [len(name) + 2 for name in runs])
    print(f"\n{'schedule':<{width}}{'ms/iter':>10}{'tokens/s':>10}"
          + (f"{'wall ms/iter':>14}{'held s':>8}{'x first':>9}  runs (wall ms/iter)" if saves
             else "  runs (ms/iter)"))
    summary, first_wall = {}, None
    for schedule, results in runs.items():
        ms = statistics.median(x["ms_per_iter"] for x in results)
        wall = statistics.median(x["wall_ms_per_iter"] for x in results)
        held = [s for x in results for s in x["save_held_s"]]
        first_wall = first_wall or wall
        tokens = round(results[0]["tokens_per_iter"])  # global batch x sequence
        summary[schedule] = {"ms_per_iter": ms, "tokens_per_s": tokens / ms * 1e3,
                             "wall_ms_per_iter": wall,
                             "save_held_s": statistics.fmean(held) if held else None,
                             "runs": [x["ms_per_iter"] for x in results],
                             "wall_runs": [x["wall_ms_per_iter"] for x in results],
                             "chosen": [x["chosen"] for x in results]}  # auto's, each run's
        chosen = {x["chosen"] for x in results}
        one = chosen.pop() if len(chosen) == 1 else None  # else each run names its own
        name = f"{schedule}={one}" if one else schedule
        line = f"{name:<{width}}{ms:>10.1f}{tokens / ms * 1e3:>10.0f}"
        if saves:
            line += (f"{wall:>14.1f}{summary[schedule]['save_held_s'] or 0:>8.2f}"
                     f"{wall / first_wall:>9.3f}")
        key = "wall_ms_per_iter" if saves else "ms_per_iter"
        print(line + "  " + ", ".join(f"{x[key]:.1f}" + (f" ({x['chosen']})" if x["chosen"]
                                                          and not one else "")
                                      for x in results))
    return summary


def main(argv=None) -> int:
    args = parse(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    runs = {s: [] for s in args.schedule_list}
    launches = args.runs * len(args.schedule_list)
    print(f"bench_e2e: {launches} launches ({args.runs} runs x {len(args.schedule_list)} "
          f"schedules, {args.train_iters} iterations each: about 1 minute each on 4 ranks of a "
          f"2-core machine at the defaults; each one then shows the ETA)", flush=True)
    progress = Progress(launches, "bench_e2e launches")
    for r in range(args.runs):
        order = args.schedule_list[r % len(args.schedule_list):] + \
            args.schedule_list[:r % len(args.schedule_list)]  # rotate who goes first
        for schedule in order:
            run_dir = os.path.join(args.out_dir, f"{schedule}_{r}")
            start = time.monotonic()
            returncode, stdout, stamps = run_timed(command(args, schedule, run_dir), env, ROOT)
            shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
            output = training_log(args.nodes, run_dir, stdout)
            if returncode != 0:
                print(output[-3000:], file=sys.stderr)
                print(f"bench_e2e: {schedule} run {r + 1} failed (exit {returncode})",
                      file=sys.stderr)
                return 1
            rows = intervals(output)
            held = save_held(stdout)
            runs[schedule].append({"ms_per_iter": run_figure(rows), "intervals": rows,
                                   "wall_ms_per_iter": (wall_figure(stamps) if args.nodes == 1
                                                        else float("nan")),
                                   "save_held_s": held,
                                   "tokens_per_iter": rows[-1][1] * rows[-1][2] / 1e3,
                                   "wall_s": time.monotonic() - start,
                                   # auto's choice, printed by rank 0: node 0's output
                                   # (stdout) across nodes
                                   "chosen": chosen_row(stdout + output)})
            last = runs[schedule][-1]
            wall = last["wall_ms_per_iter"]  # (measured on one node only)
            print(f"run {r + 1}/{args.runs} {schedule:<10} {last['ms_per_iter']:8.1f} ms/iter"
                  + (f", wall {wall:8.1f}" if wall == wall else ""), flush=True)
            progress.done(f"{schedule} run {r + 1}")
    summary = _summary(runs, args.save_interval)
    path = args.json or os.path.join(args.out_dir, "bench_e2e.json")
    with open(path, "w") as f:
        json.dump({"argv": argv if argv is not None else sys.argv[1:], "summary": summary,
                   "runs": runs}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    end(main())
