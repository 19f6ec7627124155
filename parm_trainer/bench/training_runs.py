"""A training run's figures from its log, for the end-to-end benchmarks (tools/bench_e2e.py,
tools/bench_pipeline.py): the logged intervals' ms/iter and tokens/s, the wall time between
logged lines, what each save held training up, and per-rank timer rows.

    code, output, stamps = run_timed(cmd, env, cwd)
    rows = intervals(output); ms = run_figure(rows)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import time

# `make demo`'s model (scripts/demo_gpt_moe.sh: Mixtral-shaped, no dropout) at a benchmark's
# batch, with the scripts' --overlap-grad-reduce and --overlap-moe-expert-parallel-comm (which
# megatron's layer ignores): the default model of tools/bench_e2e.py and
# tools/bench_plan.py
DEMO_MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
              "--seq-length", "128", "--max-position-embeddings", "128", "--disable-bias-linear",
              "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
              "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
              "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
              "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "4", "--overlap-grad-reduce",
              "--overlap-moe-expert-parallel-comm",
              "--global-batch-size", "16", "--lr", "1e-3", "--lr-warmup-iters", "0",
              "--seed", "1234", "--split", "969,30,1", "--eval-iters", "0",
              "--tokenizer-type", "SentencePieceTokenizer"]

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| ms/iter ([\d.]+) \| tokens/s ([\d.]+)")
SAVE_HELD = re.compile(r"^saved checkpoint \S+ in ([\d.]+) s$|training waited ([\d.]+) s\)$",
                       re.M)


def intervals(output: str) -> list:
    """[(iteration, ms/iter, tokens/s)] of the training log lines in output."""
    return [(int(i), float(ms), float(tps)) for i, ms, tps in LINE.findall(output)]


def run_figure(rows: list) -> float:
    """Mean ms/iter of the logged intervals after the first (start-up, warm-up)."""
    if len(rows) < 2:
        raise ValueError(f"need at least 2 logged intervals, got {len(rows)}: raise "
                         "--train-iters or lower --log-interval")
    return statistics.fmean(ms for _, ms, _ in rows[1:])


def wall_figure(stamps: list) -> float:
    """ms per iteration between the first and the last logged line's arrival, [(iteration,
    seconds)]: whatever the loop did between them (saves, their waits) included."""
    if len(stamps) < 2:
        return float("nan")
    (first, t0), (last, t1) = stamps[0], stamps[-1]
    return (t1 - t0) / (last - first) * 1e3


def save_held(output: str) -> list:
    """Seconds training waited for each save, from the log."""
    return [float(sync or background) for sync, background in SAVE_HELD.findall(output)]


def run_timed(cmd: list, env: dict, cwd: str) -> tuple:
    """(exit status, output, [(iteration, arrival seconds)] of the logged iteration lines)."""
    process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines, stamps = [], []
    for line in process.stdout:
        now = time.monotonic()
        lines.append(line)
        match = LINE.search(line)
        if match:
            stamps.append((int(match.group(1)), now))
    return process.wait(), "".join(lines), stamps


def training_log(nodes: int, run_dir: str, stdout: str) -> str:
    """The training log of a run launched by cluster.launch.launch_command(..., run_dir/nodes,
    ...): stdout on one node; across emulated nodes megatron prints on the last rank, which is
    in the last node's log."""
    if nodes == 1:
        return stdout
    with open(os.path.join(run_dir, "nodes", f"node{nodes - 1}.log")) as f:
        return f.read()


def add_run_flags(parser, name: str) -> None:
    """The flags every end-to-end benchmark takes: the data, where its runs and JSON go, and
    the flags after -- for pretrain_gpt_moe.py (parse_run_flags reads them)."""
    parser.add_argument("--data-path", default="data/demo/corpus_text_document")
    parser.add_argument("--tokenizer-model", default="data/demo/tokenizer.model")
    parser.add_argument("--out-dir", default=f"runs/{name}")
    parser.add_argument("--json", default=None, help=f"default: OUT_DIR/{name}.json")
    parser.add_argument("extra", nargs=argparse.REMAINDER,
                        help="-- flags for pretrain_gpt_moe.py")


def parse_run_flags(parser, argv, root: str):
    """parser's arguments (--runs at least 1), the extra flags without their --, the data
    checked to exist."""
    args = parser.parse_args(argv)
    args.extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    for path in (args.data_path + ".idx", args.tokenizer_model):
        if not os.path.exists(os.path.join(root, path)):
            parser.error(f"{path} not found: run `make data` first, or pass --data-path and "
                         "--tokenizer-model")
    return args


PREDICTED = re.compile(r"^predicted forward \+ backward per micro-batch \(.*\): (.*); "
                       r"([\d.]+) ms per iteration$", re.M)


def predicted_stage_ms(output: str) -> tuple:
    """([ms per micro-batch of each pipeline rank], ms per iteration) from the start-up line."""
    match = PREDICTED.search(output)
    if not match:
        raise ValueError("no 'predicted forward + backward per micro-batch' line in the log")
    stages = re.findall(r"PP rank \d+ ([\d.]+) ms", match.group(1))
    return [float(ms) for ms in stages], float(match.group(2))


def timer_rows(output: str, name: str) -> dict:
    """{global rank: ms per iteration} of timer `name` in the last `--timing-log-option all`
    block of the log."""
    blocks = output.split("times across ranks (ms):")
    if len(blocks) < 2:
        raise ValueError("no 'times across ranks' block: run with --timing-log-level 2 "
                         "--timing-log-option all")
    section = re.search(rf"^  {re.escape(name)}:\n((?:     rank +\d+: [\d.]+\n?)+)", blocks[-1],
                        re.M)
    if not section:
        return {}
    return {int(rank): float(ms) for rank, ms in
            re.findall(r"rank +(\d+): ([\d.]+)", section.group(1))}


def measured_stage_ms(output: str, pp: int, world: int, microbatches: int) -> list:
    """Each pipeline rank's forward-compute + backward-compute per micro-batch (megatron's
    level-2 timers, max over the stage's ranks; PP is megatron's outermost group, so global
    rank g is on pipeline rank g // (world / pp))."""
    forward, backward = timer_rows(output, "forward-compute"), timer_rows(output,
                                                                         "backward-compute")
    per_stage = world // pp
    return [max(forward.get(g, 0.0) + backward.get(g, 0.0)
                for g in range(s * per_stage, (s + 1) * per_stage)) / microbatches
            for s in range(pp)]
