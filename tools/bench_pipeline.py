"""python tools/bench_pipeline.py --nproc 2 --pp 2 --layouts even,auto --runs 3 [--profile P] [-- FLAGS]

Training speed of pretrain_gpt_moe.py under pipeline stage layouts, end to end, side by side:
"even" is megatron's even split of the decoder layers (no stage flag), "auto"
--pipeline-model-parallel-layout auto (the stage builder, parm_trainer/planning/), any other
row a layout string given as is ("Etttttttt|L"); without --profile auto prices the pieces by
their seconds measured at start-up (cached after the first run; each auto run's line says
which). The runs alternate (A, B, then B, A, ...), and
each row's figure is the median over its --runs runs of the mean ms/iter of the logged
intervals after the first; "x first" is the first row's ms/iter over this row's (> 1: faster).

The default model is head-heavy: 8 layers, hidden 128, MoE every other layer (4 experts,
top-2), sequence 256 and the vocabulary padded to 32000 entries (--make-vocab-size-divisible-by
32000 on the demo tokenizer), so the output layer and its cross entropy outweigh a few decoder
layers and the even split leaves the last stage setting the pace. Flags after -- go to
pretrain_gpt_moe.py last (they override the model's).

Per-stage times (unless --no-stage-times): one more run per row at --timing-log-level 2
--timing-log-option all gives each pipeline rank's forward-compute + backward-compute per
micro-batch (megatron's timers; P2P waits excluded), printed beside what the start-up log
predicted for it (the same model the stage builder splits by, priced with --profile or the
default profile), and the median relative error over every row's stages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

from parm_trainer.process_exit import end
from parm_trainer.arguments import parse_args
from parm_trainer.bench.training_runs import (add_run_flags, intervals, measured_stage_ms,
                                             parse_run_flags, predicted_stage_ms, run_figure,
                                             run_timed)
from parm_trainer.cluster.launch import launch_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "256", "--max-position-embeddings", "256", "--disable-bias-linear",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
         "--moe-layer-freq", "2", "--make-vocab-size-divisible-by", "32000",
         "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--lr", "1e-3", "--lr-warmup-iters", "0", "--seed", "1234", "--split", "969,30,1",
         "--eval-iters", "0", "--tokenizer-type", "SentencePieceTokenizer"]
STAGES = re.compile(r"^pipeline layout (\S+) \(", re.M)
MEASURED = re.compile(r"^layer times for the stage builder.*\((.*)\)$", re.M)


def layout_flags(row: str) -> list:
    """A row's stage flags: "even" none, "auto" the stage builder, else a layout string."""
    if row == "even":
        return []
    return ["--pipeline-model-parallel-layout", row]


def command(args, row: str, run_dir: str, timed: bool = False) -> list:
    flags = [*MODEL, "--pipeline-model-parallel-size", str(args.pp), "--train-iters",
             str(args.train_iters), "--log-interval", str(args.log_interval),
             "--eval-interval", str(args.train_iters + 1), "--data-path", args.data_path,
             "--tokenizer-model", args.tokenizer_model, "--data-cache-path",
             os.path.join(run_dir, "data_cache"), *layout_flags(row)]
    if args.profile:
        flags += ["--moe-parm-cost-profile", args.profile]
    if timed:
        flags += ["--timing-log-level", "2", "--timing-log-option", "all"]
    flags += args.extra
    return launch_command(args.nproc, 1, "", os.path.join(run_dir, "nodes"),
                          ["pretrain_gpt_moe.py", *flags])


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--pp", type=int, default=2, help="--pipeline-model-parallel-size")
    p.add_argument("--layouts", default="even,auto", help="rows: even, auto or layout strings")
    p.add_argument("--runs", type=int, default=3, help="runs per row (median)")
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--profile", default=None, help="--moe-parm-cost-profile for every run")
    p.add_argument("--no-stage-times", action="store_false", dest="stage_times")
    add_run_flags(p, "bench_pipeline")
    args = parse_run_flags(p, argv, ROOT)
    if args.nproc % args.pp:
        p.error("--nproc must be a multiple of --pp")
    args.rows = [r for r in args.layouts.split(",") if r]
    return args


def _run(args, row: str, run_dir: str, env: dict, timed: bool = False) -> str:
    code, output, _ = run_timed(command(args, row, run_dir, timed), env, ROOT)
    if code != 0:
        print(output[-3000:], file=sys.stderr)
        raise SystemExit(f"bench_pipeline: the {row} run failed (exit {code})")
    return output


def stage_table(args, env: dict) -> dict:
    """One timed run per row: predicted against measured per-stage ms per micro-batch."""
    model = parse_args([*MODEL, *args.extra], world_size=args.nproc)
    dp = args.nproc // (model.tensor_model_parallel_size * args.pp)
    microbatches = model.global_batch_size // (model.micro_batch_size * dp)
    table = {}
    for row in args.rows:
        output = _run(args, row, os.path.join(args.out_dir, f"{row}_timed"), env, timed=True)
        predicted, _ = predicted_stage_ms(output)
        measured = measured_stage_ms(output, args.pp, args.nproc, microbatches)
        table[row] = {"predicted_ms": predicted, "measured_ms": measured}
    print(f"\n{'layout':<14}{'PP rank':>8}{'predicted ms':>14}{'measured ms':>13}{'error':>8}")
    errors = []
    for row, figures in table.items():
        for rank, (p, m) in enumerate(zip(figures["predicted_ms"], figures["measured_ms"])):
            errors.append(abs(p - m) / m)
            print(f"{row:<14}{rank:>8}{p:>14.2f}{m:>13.2f}{(p - m) / m:>+8.1%}")
    print(f"median |error| over {len(errors)} stages: {statistics.median(errors):.1%}")
    return {"stages": table, "median_abs_error": statistics.median(errors)}


def main(argv=None) -> int:
    args = parse(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    runs = {row: [] for row in args.rows}
    for r in range(args.runs):
        order = args.rows[r % len(args.rows):] + args.rows[:r % len(args.rows)]
        for row in order:
            output = _run(args, row, os.path.join(args.out_dir, f"{row}_{r}"), env)
            rows = intervals(output)
            chosen = STAGES.search(output)
            runs[row].append({"ms_per_iter": run_figure(rows), "intervals": rows,
                              "tokens_per_iter": rows[-1][1] * rows[-1][2] / 1e3,
                              "layout": chosen.group(1) if chosen else None})
            measured = MEASURED.search(output)  # auto with no profile: the pieces' source
            runs[row][-1]["layer_times"] = measured.group(1) if measured else None
            print(f"run {r + 1}/{args.runs} {row:<12} {runs[row][-1]['ms_per_iter']:8.1f} ms/iter"
                  f" ({runs[row][-1]['layout']}" + (f"; layer times {measured.group(1)}"
                                                    if measured else "") + ")", flush=True)
    print(f"\n{'layout':<14}{'stages':<18}{'ms/iter':>10}{'tokens/s':>10}{'x first':>9}  runs")
    summary, first = {}, None
    for row, results in runs.items():
        ms = statistics.median(x["ms_per_iter"] for x in results)
        first = first or ms
        tokens = results[0]["tokens_per_iter"] / ms * 1e3
        summary[row] = {"ms_per_iter": ms, "tokens_per_s": tokens, "x_first": first / ms,
                        "layout": results[0]["layout"],
                        "runs": [x["ms_per_iter"] for x in results]}
        print(f"{row:<14}{results[0]['layout'] or '?':<18}{ms:>10.1f}{tokens:>10.0f}"
              f"{first / ms:>9.3f}  " + ", ".join(f"{x['ms_per_iter']:.1f}" for x in results))
    result = {"argv": argv if argv is not None else sys.argv[1:], "summary": summary,
              "runs": runs}
    if args.stage_times:
        result.update(stage_table(args, env))
    path = args.json or os.path.join(args.out_dir, "bench_pipeline.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    end(main())
