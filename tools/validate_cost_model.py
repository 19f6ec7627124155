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
OUT/validation.png plots predicted against measured.

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
import statistics
import subprocess
import sys
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parm_trainer.moe.cost_model import (LAYER_DEFAULT, LAYER_KEYS, LayerShape,  # noqa: E402
                                         Profile, choose_schedule, plan_cost, shape_plan)
from parm_trainer.progress import Progress  # noqa: E402

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

from emulated_cluster import add_node_flags, launch_command  # noqa: E402

SCHEDULES = ("baseline", "s1", "s2")
PIPELINED = ("s1", "s2")
MARGIN = 0.05
FOLDS = 2  # cross-validation: each half of the grid is predicted by terms fitted on the other

# (MP, EP, ESP, sequence parallel) on 4 ranks; baseline needs ESP = MP and is skipped elsewhere.
# MP is at least 2: with MP 1 there is nothing to pause and s1, s2 and baseline are one plan.
LAYOUTS = [(2, 2, 2, False), (2, 1, 2, False), (2, 2, 2, True), (4, 1, 4, False),
           (2, 4, 1, False), (2, 2, 1, True), (4, 2, 2, False), (4, 4, 1, True)]
# (seq, micro-batch, hidden, ffn, experts, top-k, capacity factor or None)
SHAPES = [(64, 2, 64, 128, 4, 2, None), (128, 4, 256, 512, 4, 2, None),
          (256, 2, 128, 256, 4, 2, 1.0), (128, 2, 512, 1024, 8, 2, None),
          (128, 4, 128, 512, 8, 2, 1.5), (256, 4, 64, 256, 4, 3, None),
          (512, 2, 128, 256, 8, 2, 1.0), (64, 4, 256, 1024, 4, 2, 2.0)]
# Across emulated nodes (--nodes): layers whose AlltoAlls outweigh the shaper's bucket (tbf
# lets its first 250 KB through at once), so the link, not the bucket, sets their time, as
# on a real link. None is a shape of the pipelining benchmarks in docs/benchmarks.md.
NODE_SHAPES = [(256, 4, 128, 256, 4, 2, None), (256, 2, 256, 512, 8, 2, None),
               (512, 2, 128, 512, 4, 2, 1.0), (256, 4, 192, 384, 4, 2, 1.5),
               (128, 4, 384, 768, 8, 2, None), (512, 4, 64, 256, 8, 3, None),
               (256, 2, 512, 1024, 4, 2, 1.0), (128, 8, 256, 1024, 8, 4, None)]


def grid(layouts=LAYOUTS, shapes=SHAPES, per_shape: int = 4) -> list:
    """Every shape on `per_shape` layouts (32 configurations by default), the layouts
    rotating through the shapes so that each layout meets several shapes; a layout whose EP
    does not divide the shape's experts gives way to the next one."""
    out = []
    for i, shape in enumerate(shapes):
        chosen = []
        for j in range(per_shape):
            for k in range(len(layouts)):
                layout = layouts[(i + 2 * j + k) % len(layouts)]
                if shape[4] % layout[1] == 0 and layout not in chosen:
                    chosen.append(layout)
                    break
        out += [(layout, shape) for layout in chosen]
    return out


def node_layouts(ranks_per_node: int, world: int = 4) -> list:
    """LAYOUTS grown to `world` ranks by EP (as a job grows over nodes), keeping those whose
    MP (and so ESP) groups stay inside a node as megatron places them: on emulated nodes an MP
    group across the slow link is no layout anyone would run."""
    grow = max(1, world // 4)
    return [(mp, ep * grow, esp, sp) for mp, ep, esp, sp in LAYOUTS if mp <= ranks_per_node]


def config_argv(layout, shape, chunks: int = 1) -> list:
    """bench_moe_layer's flags for one configuration: baseline, s1 and s2 unpipelined, or s1
    and s2 in `chunks` pieces (the baseline does not pipeline)."""
    (mp, ep, esp, sp), (seq, mbs, hidden, ffn, experts, topk, factor) = layout, shape
    argv = ["--tensor-model-parallel-size", str(mp), "--expert-model-parallel-size", str(ep),
            "--expert-tensor-parallel-size", str(esp), "--num-attention-heads", "4",
            "--hidden-size", str(hidden), "--moe-ffn-hidden-size", str(ffn),
            "--seq-length", str(seq), "--micro-batch-size", str(mbs),
            "--num-experts", str(experts), "--moe-router-topk", str(topk),
            "--schedules", ",".join(SCHEDULES if chunks == 1 else PIPELINED),
            "--moe-parm-chunks", str(chunks)]
    if factor is not None:
        argv += ["--moe-expert-capacity-factor", str(factor)]
    if sp:
        argv.append("--sequence-parallel")
    return argv


def layer_shape(config: dict, bytes_per_element: int = 4) -> LayerShape:
    """The cost model's shape of one bench_moe_layer configuration (fp32)."""
    c = config
    return LayerShape(tokens=c["tokens_per_mp_group"], hidden=c["hidden_size"],
                      ffn=c["moe_ffn_hidden_size"], experts=c["num_experts"],
                      topk=c["moe_router_topk"], capacity_factor=c["moe_expert_capacity_factor"],
                      bytes_per_element=bytes_per_element, mp=c["tensor_model_parallel_size"],
                      ep=c["expert_model_parallel_size"], esp=c["expert_tensor_parallel_size"],
                      sequence_parallel=c["sequence_parallel"], chunks=c["moe_parm_chunks"],
                      dp=c.get("data_parallel_size", 1),
                      exact=c.get("moe_parm_exchange", "padded") == "exact")


def merge_rounds(paths: list) -> list:
    """bench_moe_layer runs of several rounds -> one list in the first round's order, each
    schedule's forward and backward times the mean over the rounds where it ran."""
    rounds = []
    for path in paths:
        with open(path) as f:
            rounds.append({run["name"]: run for run in json.load(f)["runs"]})
    merged = []
    for name, run in rounds[0].items():
        run = json.loads(json.dumps(run))
        for schedule, result in run["schedules"].items():
            if result.get("status") != "ok":
                continue
            for key in ("forward_ms", "backward_ms", "total_ms"):
                values = [r[name]["schedules"][schedule][key]["max"] for r in rounds]
                result[key]["max"] = statistics.fmean(values)
                result[key]["rounds"] = values
        merged.append(run)
    return merged


def measured_s(result: dict):
    """Forward + backward seconds (bench_moe_layer's total_ms: max over ranks), or None if it
    did not run."""
    if result.get("status") != "ok":
        return None
    return result["total_ms"]["max"] / 1e3


# a step of each layer term for the finite differences of parts(): factors, then seconds
_TERM_STEPS = (1e-4, 1e-4, 1e-7, 1e-7)


def parts(name: str, shape: LayerShape, profile: Profile, terms=LAYER_DEFAULT) -> np.ndarray:
    """The features the layer terms weigh: d(predicted forward + backward seconds) / d(term)
    at `terms`, one per LAYER_KEYS entry. The prediction is piecewise linear in the terms and
    scales with them (every price is a term times an isolated price), so it equals
    parts . terms. Unpipelined, the parts are the isolated collective seconds, the isolated
    compute + memory seconds, plan steps x 3 (backward twice) and collective calls; in a
    pipeline they are those on its critical path at these terms."""
    plan = shape_plan(name, shape)

    def total(t):
        return plan_cost(plan, shape, replace(profile, layer=tuple(t)))["total_s"]

    base = total(terms)
    out = []
    for j, h in enumerate(_TERM_STEPS):
        t = list(terms)
        t[j] += h
        out.append((total(t) - base) / h)
    return np.array(out)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active set (Lawson-Hanson), for a handful of columns."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            step = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + step * (z - x)
            passive &= x > 1e-15
    return x


def fit_layer_terms(features, seconds) -> tuple:
    """(comm_factor, compute_factor, host_s_per_step, s_per_call) >= 0 minimising the squared
    relative error of features @ terms against seconds (small and large layers weigh alike)."""
    a = np.asarray(features, dtype=float)
    b = np.asarray(seconds, dtype=float)
    scale = 1.0 / b
    terms = _nnls(a * scale[:, None], b * scale)
    comm, compute, host, per_call = (float(v) for v in terms)
    return max(comm, 1e-6), max(compute, 1e-6), host, per_call


def fit_plans(samples, profile: Profile, rounds: int = 12) -> tuple:
    """Layer terms for [(schedule, LayerShape, measured seconds)]: fit_layer_terms on parts()
    taken at the current terms, repeated until the terms settle (a pipeline's critical path
    depends on them; unpipelined plans settle at once). Returns the terms of the lowest
    squared relative error seen."""
    seconds = np.array([s for _, _, s in samples])
    terms, best = LAYER_DEFAULT, None
    for _ in range(rounds):
        features = np.array([parts(n, shape, profile, terms) for n, shape, _ in samples])
        predicted = features @ np.array(terms)
        score = float(np.sum(((predicted - seconds) / seconds) ** 2))
        if best is None or score < best[0] - 1e-12:
            best = (score, terms)
        new = fit_layer_terms(features, seconds)
        if np.allclose(new, terms, rtol=1e-6, atol=1e-12):
            break
        terms = new
    return best[1]


def base_name(name: str) -> str:
    """The grid configuration a run belongs to: "c03" for "c03" and its pipelined "c03r4"."""
    return name.split("r")[0]


def _samples(runs: list, names: set) -> list:
    """[(schedule, LayerShape, measured seconds)] of the runs of the grid configurations in
    names (with their pipelined runs)."""
    samples = []
    for run in runs:
        if base_name(run["name"]) in names:
            shape = layer_shape(run["config"])
            for name in SCHEDULES:
                seconds = measured_s(run["schedules"].get(name, {}))
                if seconds is not None:
                    samples.append((name, shape, seconds))
    if len(samples) < len(LAYER_KEYS):
        raise ValueError(f"{len(samples)} measured schedules to fit {len(LAYER_KEYS)} "
                         "layer terms on: measure more configurations (a larger --limit)")
    return samples


def _score(run: dict, fitted: Profile) -> dict:
    """One run's row: each schedule's predicted and measured seconds, auto's choice and the
    measured-faster of s1 and s2."""
    shape = layer_shape(run["config"])
    row = {"name": run["name"], "config": run["config"], "schedules": {}}
    for name in SCHEDULES:
        seconds = measured_s(run["schedules"].get(name, {}))
        if seconds is None:
            row["schedules"][name] = {"measured_s": None, "predicted_s": None,
                                      "reason": run["schedules"].get(name, {}).get("reason")}
            continue
        predicted = plan_cost(shape_plan(name, shape), shape, fitted)["total_s"]
        row["schedules"][name] = {"measured_s": seconds, "predicted_s": predicted,
                                  "rel_error": (predicted - seconds) / seconds}
    s1, s2 = (row["schedules"][n]["measured_s"] for n in ("s1", "s2"))
    row["auto"] = None
    try:
        row["auto"], _ = choose_schedule(shape, fitted)
    except ValueError:
        pass
    if s1 is not None and s2 is not None:
        fast, slow = sorted((s1, s2))
        row["fastest"] = "s1" if s1 <= s2 else "s2"
        row["margin"] = slow / fast - 1.0
    else:
        row["fastest"] = "s1" if s2 is None else "s2"
        row["margin"] = None
    row["auto_right"] = row["auto"] == row["fastest"]
    return row


def deal(runs: list, folds: int = FOLDS) -> list:
    """The grid configurations of each fold (sets of names): grouped by layout, in the order
    the runs first meet each layout and configuration, and dealt alternately, so that every
    layout measured in two or more configurations is in the fit of every fold."""
    layout_of = {}
    for run in runs:
        c = run["config"]
        layout_of.setdefault(base_name(run["name"]), (
            c["tensor_model_parallel_size"], c["expert_model_parallel_size"],
            c["expert_tensor_parallel_size"], c["sequence_parallel"]))
    layouts = list(dict.fromkeys(layout_of.values()))
    order = sorted(layout_of, key=lambda name: layouts.index(layout_of[name]))
    return [set(order[j::folds]) for j in range(folds)]


def evaluate(runs: list, profile: Profile, folds: int = FOLDS) -> dict:
    """Cross-validate the layer terms: the grid's configurations (with their pipelined runs)
    are dealt into `folds` folds (deal), and each fold is predicted and scored by the terms
    fitted on the others, so every configuration is held out once. The profile returned
    carries the terms fitted on all of them."""
    names = {base_name(run["name"]) for run in runs}
    if len(names) < folds:
        raise ValueError(f"{len(names)} configurations for {folds} folds: measure more "
                         "configurations (a larger --limit)")
    rows, fold_terms = {}, []
    for held in deal(runs, folds):
        terms = fit_plans(_samples(runs, names - held), profile)
        fold_terms.append(dict(zip(LAYER_KEYS, terms)))
        fitted = replace(profile, layer=terms)
        rows.update({run["name"]: _score(run, fitted) for run in runs
                     if base_name(run["name"]) in held})
    configs = [rows[run["name"]] for run in runs]
    terms = fit_plans(_samples(runs, names), profile)
    fitted = replace(profile, layer=terms)

    depths = depth_choices(configs)
    errors = [abs(s["rel_error"]) for row in configs for s in row["schedules"].values()
              if s["measured_s"] is not None]
    decided = [row for row in configs if row["margin"] is not None and row["margin"] > MARGIN]
    right = sum(row["auto_right"] for row in decided)
    summary = {
        "folds": folds, "fold_layer_terms": fold_terms, "held_out_runs": len(configs),
        "layer_terms": dict(zip(LAYER_KEYS, terms)),
        "median_abs_rel_error": statistics.median(errors) if errors else None,
        "p90_abs_rel_error": float(np.percentile(errors, 90)) if errors else None,
        "schedules_compared": len(errors),
        "decisive_configs": len(decided), "auto_right_on_decisive": right,
        "auto_right_share": right / len(decided) if decided else None,
        "auto_right_all": sum(row["auto_right"] for row in configs),
        "depth_choices": len(depths),
        "depth_within_10pct": sum(d["excess"] <= 0.10 for d in depths),
        "depth_worst_excess": max((d["excess"] for d in depths), default=None),
    }
    return {"summary": summary, "configs": configs, "depths": depths, "profile": fitted}


def depth_choices(configs: list) -> list:
    """Per held-out grid configuration and pipelined schedule measured at several chunk
    counts r: the r the model prices cheapest among them, the measured-fastest r, and how
    much slower the chosen r measured (excess)."""
    by_config = {}
    for row in configs:
        by_config.setdefault(base_name(row["name"]), []).append(row)
    out = []
    for config, rows in by_config.items():
        for name in PIPELINED:
            times = {row["config"]["moe_parm_chunks"]: row["schedules"][name] for row in rows
                     if row["schedules"].get(name, {}).get("measured_s") is not None}
            if len(times) < 2:
                continue
            chosen = min(times, key=lambda r: times[r]["predicted_s"])
            best = min(times, key=lambda r: times[r]["measured_s"])
            out.append({"config": config, "schedule": name, "chosen": chosen, "best": best,
                        "excess": times[chosen]["measured_s"] / times[best]["measured_s"] - 1})
    return out


def _terms_text(t: dict) -> str:
    return (f"collectives x{t['comm_factor']:.2f}, compute x{t['compute_factor']:.2f}, host "
            f"{t['host_s_per_step'] * 1e3:.3f} ms per plan step (backward twice), "
            f"{t['s_per_call'] * 1e3:.3f} ms per collective call")


def format_report(result: dict) -> str:
    lines = [f"{'config':<8}{'layout':<16}{'N':>6}{'M':>5}{'H':>6}{'E':>3}{'k':>2}{'f':>5}  "
             + "".join(f"{n + ' pred/meas ms':>22}" for n in SCHEDULES)
             + f"{'auto':>6}{'fastest':>8}{'margin':>8}"]
    for row in result["configs"]:
        c = row["config"]
        layout = (f"MP{c['tensor_model_parallel_size']} EP{c['expert_model_parallel_size']} "
                  f"ESP{c['expert_tensor_parallel_size']}{' SP' if c['sequence_parallel'] else ''}")
        cells = []
        for name in SCHEDULES:
            s = row["schedules"][name]
            cells.append(f"{'skipped':>22}" if s["measured_s"] is None else
                         f"{s['predicted_s'] * 1e3:>9.1f}/{s['measured_s'] * 1e3:<6.1f}"
                         f"{s['rel_error']:>+6.0%} ")
        margin = "-" if row["margin"] is None else f"{row['margin']:.0%}"
        mark = "" if row["auto_right"] else "*"
        lines.append(f"{row['name']:<8}{layout:<16}{c['tokens_per_mp_group']:>6}"
                     f"{c['hidden_size']:>5}{c['moe_ffn_hidden_size']:>6}{c['num_experts']:>3}"
                     f"{c['moe_router_topk']:>2}{str(c['moe_expert_capacity_factor'] or '-'):>5}  "
                     + "".join(cells) + f"{str(row['auto']) + mark:>6}{row['fastest']:>8}"
                     f"{margin:>8}")
    s = result["summary"]
    t = s["layer_terms"]
    lines += [
        "* auto did not pick the measured-faster of s1 and s2",
        "layer terms fitted on all configurations (OUT/profile.json): "
        + _terms_text(t),
        f"each of the {s['folds']} folds predicted by the terms fitted on the others: "
        + "; ".join(_terms_text(f) for f in s["fold_layer_terms"]),
        f"held out: {s['held_out_runs']} runs, {s['schedules_compared']} measured "
        f"schedules; median |predicted - measured| / measured = "
        f"{s['median_abs_rel_error']:.1%} (90th percentile {s['p90_abs_rel_error']:.1%})",
        f"auto picked the measured-faster of s1/s2 in {s['auto_right_on_decisive']} of "
        f"{s['decisive_configs']} configurations where it wins by more than {MARGIN:.0%}"
        + (f" ({s['auto_right_share']:.0%})" if s["auto_right_share"] is not None else "")
        + f"; {s['auto_right_all']} of {s['held_out_runs']} overall",
    ]
    if s["depth_choices"]:
        missed = ", ".join(f"{d['config']} {d['schedule']} r{d['chosen']} for r{d['best']}"
                           for d in result["depths"] if d["chosen"] != d["best"])
        lines.append(
            f"chunk count r: the model's r measured within 10% of the fastest r in "
            f"{s['depth_within_10pct']} of {s['depth_choices']} (configuration, schedule) pairs;"
            f" worst {s['depth_worst_excess']:+.0%}" + (f" ({missed})" if missed else ""))
    return "\n".join(lines)


def write_png(result: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    every = []
    for name, marker in zip(SCHEDULES, "os^"):
        pts = [(s["measured_s"] * 1e3, s["predicted_s"] * 1e3) for row in result["configs"]
               for n, s in row["schedules"].items() if n == name and s["measured_s"]]
        if pts:
            ax.scatter(*zip(*pts), label=name, marker=marker, alpha=0.7)
            every += [v for p in pts for v in p]
    lo, hi = min(every) * 0.8, max(every) * 1.25
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="predicted = measured")
    ax.plot([lo, hi], [lo * 1.25, hi * 1.25], "k:", lw=1, label="+-25%")
    ax.plot([lo, hi], [lo * 0.75, hi * 0.75], "k:", lw=1)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="measured forward+backward (ms)", ylabel="predicted (ms)",
           title="MoE layer cost model, held-out configurations")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


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
    sys.exit(main())
