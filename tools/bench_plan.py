"""python tools/bench_plan.py --nodes 2 --gpus-per-node 2 [--profile P] [--top 12 --others 4] [-- MODEL FLAGS]

The planner against the clock: ranks every layout of the model on the cluster as
tools/plan_layout.py does (same flags, same cost model), then trains the first --top of them
and --others more spread over the rest of the ranking, each as a user would launch it (the
planner's flags: TP, EP, ESP, PP with its stage layout, virtual stages; the MoE schedule and
depth left to auto at start-up), and prints predicted against measured ms/iter, the rank
correlation (Spearman) of the two, and the first choice's time over the fastest measured.

--nodes > 1 runs on emulated nodes (tools/emulated_cluster.py, as root) at
--inter-node-bandwidth; each figure is the median over --runs runs (alternating: every layout
once, then again) of the mean ms/iter of the logged intervals after the first; with --runs 2
or more it also prints how well the runs rank the layouts against each other (the bench's own
noise: a cost model cannot agree with the runs much better than they agree). MODEL FLAGS
(after --) default to `make demo`'s model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from parm_trainer.process_exit import end
from parm_trainer.arguments import parse_args
from parm_trainer.bench.plan_check import pick, run_agreement, spearman
from parm_trainer.bench.training_runs import (DEMO_MODEL, add_run_flags, intervals,
                                             parse_run_flags, run_figure, run_timed,
                                             training_log)
from parm_trainer.cluster.launch import add_node_flags, launch_command
from parm_trainer.data.tokenizer import build_tokenizer
from parm_trainer.moe.cost_profile import DEFAULT_PROFILE, Profile
from parm_trainer.planning.search import candidates

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = DEMO_MODEL


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus-per-node", type=int, default=2, help="ranks per node")
    p.add_argument("--profile", default=None, help="the planner's cost profile")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--others", type=int, default=4)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--log-interval", type=int, default=5)
    add_node_flags(p)
    add_run_flags(p, "bench_plan")
    return parse_run_flags(p, argv, ROOT)


def command(args, flags: list, run_dir: str) -> list:
    run = [*MODEL, *args.extra, *flags, "--train-iters", str(args.train_iters),
           "--log-interval", str(args.log_interval), "--eval-interval",
           str(args.train_iters + 1), "--data-path", args.data_path, "--tokenizer-model",
           args.tokenizer_model, "--data-cache-path", os.path.join(run_dir, "data_cache")]
    return launch_command(args.nodes * args.gpus_per_node, args.nodes, args.inter_node_bandwidth,
                          os.path.join(run_dir, "nodes"), ["pretrain_gpt_moe.py", *run])


def ranked_layouts(args) -> list:
    profile = Profile.from_json(args.profile) if args.profile else DEFAULT_PROFILE
    model = parse_args([*MODEL, *args.extra], world_size=1)
    vocab = build_tokenizer(model.tokenizer_type, args.tokenizer_model).vocab_size
    return candidates(model, profile, args.nodes, args.gpus_per_node, vocab)


def main(argv=None) -> int:
    args = parse(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    ranked = ranked_layouts(args)
    chosen = pick(len(ranked), args.top, args.others)
    print(f"{len(ranked)} layouts ranked; running {len(chosen)}: ranks "
          + ", ".join(str(i + 1) for i in chosen), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    measured = {i: [] for i in chosen}
    for r in range(args.runs):
        for i in chosen:
            run_dir = os.path.join(args.out_dir, f"rank{i + 1}_{r}")
            code, stdout, _ = run_timed(command(args, ranked[i].flags(), run_dir), env, ROOT)
            output = training_log(args.nodes, run_dir, stdout)
            if code != 0:
                print(output[-3000:], file=sys.stderr)
                print(f"bench_plan: layout {i + 1} failed (exit {code})", file=sys.stderr)
                return 1
            measured[i].append(run_figure(intervals(output)))
            print(f"run {r + 1}/{args.runs} layout {i + 1:>3}: {measured[i][-1]:8.1f} ms/iter "
                  f"(predicted {ranked[i].iteration_s * 1e3:.1f})", flush=True)
    ms = {i: statistics.median(runs) for i, runs in measured.items()}
    print(f"\n{'rank':>4} {'TP':>3} {'EP':>3} {'ESP':>3} {'PP':>3} {'VP':>3} {'DP':>3} "
          f"{'predicted':>10} {'measured':>9}  layout")
    for i in chosen:
        c = ranked[i]
        print(f"{i + 1:>4} {c.tp:>3} {c.ep:>3} {c.esp:>3} {c.pp:>3} {c.vp:>3} {c.dp:>3} "
              f"{c.iteration_s * 1e3:>10.1f} {ms[i]:>9.1f}  {c.layout}")
    rho = spearman([ranked[i].iteration_s for i in chosen], [ms[i] for i in chosen])
    fastest = min(ms, key=ms.get)
    print(f"rank correlation (Spearman) of predicted and measured: {rho:.3f}; the first choice "
          f"takes {ms[chosen[0]] / ms[fastest]:.3f} x the fastest measured (rank {fastest + 1})")
    agreement = run_agreement([measured[i] for i in chosen])
    if agreement is not None:
        print(f"the runs against each other (Spearman of one run's times against another's, "
              f"median over pairs): {agreement:.3f}")
    path = args.json or os.path.join(args.out_dir, "bench_plan.json")
    with open(path, "w") as f:
        json.dump({"argv": argv if argv is not None else sys.argv[1:], "spearman": rho,
                   "run_agreement": agreement,
                   "first_over_fastest": ms[chosen[0]] / ms[fastest],
                   "layouts": [{**vars(ranked[i]), "rank": i + 1, "flags": ranked[i].flags(),
                                "measured_ms": measured[i]} for i in chosen]}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    end(main())
