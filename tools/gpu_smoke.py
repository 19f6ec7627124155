"""python tools/gpu_smoke.py [--dry-run] [--nproc N] [--data-path P --tokenizer-model T]

The GPU check (scripts/gpu_smoke.sh runs it): on one machine with NVIDIA GPUs, in a few
minutes, each stage a command of the project's own, then one summary table.

1. environment: torch, CUDA, the GPUs, NCCL; whether Transformer Engine, apex and grouped_gemm
   are installed and what the stages below use of them (megatron's local spec takes apex's
   fused LayerNorm by itself; Transformer Engine is --transformer-impl transformer_engine);
2. collectives: tools/check_collectives.py, comm.py's ops on NCCL against gloo (fp32, bf16);
3. MoE layer fp32: tools/bench_moe_layer.py, every schedule against the reference: max abs
   diff <= 1e-5 x max(1, the reference's largest value) for output, input, gate and expert
   grads (TF32 off);
4. MoE layer bf16: the same in bf16 against the fp32 reference on the same (bf16) values:
   relative L2 error <= 2e-2 for output and input grad, <= 5e-2 for gate and expert grads;
5. MoE layer, grouped experts: stage 4 with each rank's experts in grouped GEMMs
   (--moe-grouped-gemm): Transformer Engine's TEGroupedMLP and fused layers where it is
   installed (--transformer-impl transformer_engine), else megatron's GroupedMLP where the
   grouped_gemm package is (--dry-run: GroupedMLP on CPU, one matmul per expert); the same
   tolerances, and the experts must be the module named;
6. timed table: bench_moe_layer at a larger shape, Parm's schedules and megatron's;
7. short pretrain: 20 iterations of pretrain_gpt_moe.py in bf16 (fp32 with --dry-run) on the
   demo data, with stage 5's flags where it ran (and LayerNorm where apex is installed and
   Transformer Engine is not used, so apex's fused LayerNorm runs); the loss must be finite
   and fall; the row names the modules megatron built.

Stages 3-6 run in one launch of bench_moe_layer (one rendezvous and start-up, not four; the
summary gives its time to the first of them); where it fails, each runs in a launch of its own.

--dry-run runs every stage on CPU with gloo and small shapes (the test suite does), so the
script is known to work before anyone spends GPU time on it. Ranks: one per GPU (NCCL needs
a GPU per rank; with one GPU the multi-rank stages say so and run on one rank); --dry-run: 2.
Exit status 0 only if every stage that ran passed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from parm_trainer.process_exit import end
from parm_trainer.bench.smoke import (LAYER_STAGES, NO_GROUPED, layout_flags, run,
                                      stage_layer_bf16, stage_layer_fp32, stage_layer_grouped,
                                      stage_timed, torchrun)
from parm_trainer.models.backend import grouped_experts, installed, library_report


def stage_environment(args) -> tuple:
    import torch

    parts = [f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        parts += [f"CUDA {torch.version.cuda}", f"{torch.cuda.device_count()} x {', '.join(names)}",
                  f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"]
    else:
        parts.append("no CUDA (dry run)" if args.dry_run else "no CUDA")
    parts.append(library_report(("transformer_engine", "apex", "grouped_gemm")))
    flags, experts = grouped_experts(not args.dry_run)
    parts.append(f"stage 5: {' '.join(flags)} ({experts})" if flags else f"stage 5: {NO_GROUPED}")
    if installed("apex"):
        parts.append("apex's FusedLayerNorm in megatron's local LayerNorm layers")
    ok = args.dry_run or torch.cuda.is_available()
    return ok, "; ".join(parts), ""


def stage_collectives(args) -> tuple:
    if args.nproc < 2:
        return None, "skipped: one GPU (NCCL needs a GPU per rank)", ""
    status, output = run(torchrun(args.nproc) + ["tools/check_collectives.py"], 300)
    lines = [line for line in output.splitlines() if line.startswith(("ok  ", "FAIL"))]
    failed = [line for line in lines if line.startswith("FAIL")]
    ok = status == 0 and lines and not failed
    return ok, f"{len(lines) - len(failed)}/{len(lines)} ops agree" + (
        f"; first failure: {failed[0]}" if failed else ""), output


def pretrain_backend(args) -> list:
    """Stage 5's flags for the bf16 pretrain (the fp32 dry run keeps SequentialMLP: megatron's
    GroupedMLP is bf16 only), and LayerNorm where apex is installed and Transformer Engine is
    not used (megatron's local spec takes apex's fused LayerNorm; it has no fused RMSNorm)."""
    if args.dry_run:
        return []
    flags, _ = grouped_experts(cuda=True)
    if installed("apex") and "transformer_engine" not in flags:
        flags = [*flags, "--normalization", "LayerNorm"]
    return flags


def stage_pretrain(args) -> tuple:
    dtype = [] if args.dry_run else ["--bf16"]
    if not os.path.exists(args.data_path + ".idx"):
        return False, f"no dataset {args.data_path}.idx (run `make data` first)", ""
    _, nproc, *parallel = layout_flags(args.nproc)  # the layer stages' layout
    backend = pretrain_backend(args)
    nproc = int(nproc)
    command = torchrun(nproc) + [
        "pretrain_gpt_moe.py", "--num-layers", "2", "--hidden-size", "128",
        "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
        "--disable-bias-linear", "--normalization", "RMSNorm", "--swiglu",
        "--position-embedding-type", "rope", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "20", "--lr", "1e-3", "--log-interval", "5",
        "--eval-iters", "0", "--split", "90,5,5", "--moe-parm-tune-cache", "none",
        "--hidden-dropout", "0",
        "--attention-dropout", "0", "--data-path", args.data_path, "--tokenizer-model",
        args.tokenizer_model, "--data-cache-path", os.path.join(args.out_dir, "data_cache"),
        "--timing-log-level", "1", *parallel, *dtype, *backend]
    status, output = run(command, 600)
    losses = [float(v) for v in re.findall(r"^iteration .*?\| lm loss ([\d.naninf]+)",
                                           output, re.M)]
    speed = re.findall(r"ms/iter ([\d.]+) \| tokens/s (\d+)", output)
    ok = status == 0 and len(losses) >= 2 and all(v == v and v < 1e9 for v in losses) \
        and losses[-1] < losses[0]
    detail = (f"{' '.join(['bf16' if dtype else 'fp32', *backend])} on {nproc} rank(s), lm loss "
              f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "no iteration logged")
    if speed:
        detail += f", last interval {speed[-1][0]} ms/iter, {speed[-1][1]} tokens/s"
    modules = re.search(r"^modules \(.*?\): (.*?);", output, re.M)  # what megatron built
    if modules:
        detail += f"; {modules.group(1)}"
    return ok, detail, output


STAGES = (("environment", stage_environment), ("collectives", stage_collectives),
          ("MoE layer fp32", stage_layer_fp32), ("MoE layer bf16", stage_layer_bf16),
          ("MoE layer, grouped experts", stage_layer_grouped),
          ("timed layer table", stage_timed), ("short pretrain", stage_pretrain))


def _asked(args, name: str) -> bool:
    return not args.wanted or [n for n, _ in STAGES].index(name) + 1 in args.wanted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="every stage on CPU (gloo), small shapes: checks the script itself")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks (default: one per GPU, at most 8; --dry-run: 2)")
    p.add_argument("--data-path", default="data/demo/corpus_text_document")
    p.add_argument("--tokenizer-model", default="data/demo/tokenizer.model")
    p.add_argument("--out-dir", default="runs/gpu_smoke")
    p.add_argument("--only", default=None, help="comma-separated stage numbers to run (1-7)")
    args = p.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device here; run with --dry-run to check the script on CPU",
              file=sys.stderr)
        return 2
    if args.nproc is None:
        args.nproc = 2 if args.dry_run else min(8, torch.cuda.device_count())
    os.makedirs(args.out_dir, exist_ok=True)
    args.wanted = {int(s) for s in args.only.split(",")} if args.only else None
    args.layer_stages = [name for name in LAYER_STAGES if _asked(args, name)]
    args.layer_runs = None  # stages 3-6's one launch, made by the first of them (smoke.py)
    rows, failed = [], 0
    for number, (name, stage) in enumerate(STAGES, start=1):
        if not _asked(args, name):
            continue
        start = time.monotonic()
        ok, detail, output = stage(args)
        seconds = time.monotonic() - start
        verdict = "skip" if ok is None else ("ok" if ok else "FAIL")
        failed += verdict == "FAIL"
        print(f"[{number}/{len(STAGES)}] {name}: {verdict} ({seconds:.1f} s) {detail}", flush=True)
        if verdict == "FAIL" or (name == "timed layer table" and output):
            print(output[-6000:], flush=True)
        rows.append((name, verdict, f"{seconds:.1f}", detail))
    width = max(len(r[0]) for r in rows)
    print(f"\ngpu_smoke summary ({'dry run, CPU' if args.dry_run else 'GPU'}, "
          f"{args.nproc} rank(s)):")
    print(f"| {'stage'.ljust(width)} | result | s | detail |")
    print(f"|{'-' * (width + 2)}|--------|---|--------|")
    for name, verdict, seconds, detail in rows:
        print(f"| {name.ljust(width)} | {verdict} | {seconds} | {detail} |")
    if args.layer_runs is not None and args.layer_runs[0] is not None:
        print("(the layer stages ran in one launch of tools/bench_moe_layer.py: its time is on "
              "the first of them)")
    return 1 if failed else 0


if __name__ == "__main__":
    end(main())
