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
   on the compute's, a host cost per plan step and a cost per collective call) are fitted by non-negative least squares
   on the FIT configurations only (every fourth configuration of the grid) and written with
   the calibrated numbers into OUT/profile.json (load it with --moe-parm-cost-profile). The
   other configurations are held out: for each one and each schedule the tool prints the
   predicted and the measured forward + backward time, and whether auto's choice (the cheaper
   of s1 and s2 by the model) is the measured-faster of the two.

Summary (printed last and in OUT/validation.json): the median absolute relative error of
predicted against measured time over the held-out configurations and schedules; among the
held-out configurations where the faster of s1 and s2 beats the other by more than 5%, the
share where auto chose it. OUT/validation.png plots predicted against measured.

--nodes N spreads the ranks over N emulated nodes (tools/emulated_cluster.py, as root) with
--inter-node-bandwidth between them: calibration then fits intra- and inter-node collectives
separately, the grid keeps the layouts whose MP groups fit in a node (node_layouts), and their
EP (and DP) groups cross the shaped link.
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
                                         Profile, calls, choose_schedule, plan_cost, shape_plan,
                                         step_load,
                                         walk)

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

from emulated_cluster import add_node_flags, launch_command  # noqa: E402

SCHEDULES = ("baseline", "s1", "s2")
MARGIN = 0.05

# (MP, EP, ESP, sequence parallel) on 4 ranks; baseline needs ESP = MP and is skipped elsewhere.
# MP is at least 2: with MP 1 there is nothing to pause and s1, s2 and baseline are one plan.
LAYOUTS = [(2, 2, 2, False), (2, 1, 2, False), (2, 2, 2, True), (4, 1, 4, False),
           (2, 4, 1, False), (2, 2, 1, True), (4, 2, 2, False), (4, 4, 1, True)]
# (seq, micro-batch, hidden, ffn, experts, top-k, capacity factor or None)
SHAPES = [(64, 2, 64, 128, 4, 2, None), (128, 4, 256, 512, 4, 2, None),
          (256, 2, 128, 256, 4, 2, 1.0), (128, 2, 512, 1024, 8, 2, None),
          (128, 4, 128, 512, 8, 2, 1.5), (256, 4, 64, 256, 4, 3, None),
          (512, 2, 128, 256, 8, 2, 1.0), (64, 4, 256, 1024, 4, 2, 2.0)]


def grid(layouts=LAYOUTS) -> list:
    """32 configurations: every shape on four layouts, the layouts rotating through the
    shapes so that each layout meets several shapes."""
    out = []
    for i, shape in enumerate(SHAPES):
        for j in range(4):
            out.append((layouts[(i + 2 * j) % len(layouts)], shape))
    return out


def node_layouts(ranks_per_node: int) -> list:
    """The layouts whose MP (and so ESP) groups stay inside a node, as megatron places them:
    on emulated nodes an MP group across the slow link is no layout anyone would run."""
    return [layout for layout in LAYOUTS if layout[0] <= ranks_per_node]


def config_argv(layout, shape) -> list:
    (mp, ep, esp, sp), (seq, mbs, hidden, ffn, experts, topk, factor) = layout, shape
    argv = ["--tensor-model-parallel-size", str(mp), "--expert-model-parallel-size", str(ep),
            "--expert-tensor-parallel-size", str(esp), "--num-attention-heads", "4",
            "--hidden-size", str(hidden), "--moe-ffn-hidden-size", str(ffn),
            "--seq-length", str(seq), "--micro-batch-size", str(mbs),
            "--num-experts", str(experts), "--moe-router-topk", str(topk),
            "--schedules", ",".join(SCHEDULES)]
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
                      dp=c.get("data_parallel_size", 1))


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


def parts(name: str, shape: LayerShape, profile: Profile) -> np.ndarray:
    """[collective seconds, compute + memory seconds, plan steps x 3, collective calls] of one
    schedule (forward + backward), priced with the isolated profile (no layer terms): the
    features the layer terms weigh."""
    plan = shape_plan(name, shape)
    isolated = replace(profile, layer=LAYER_DEFAULT)
    no_comm = replace(isolated, collectives={k: {link: (0.0, 1e-30) for link in v}
                                             for k, v in profile.collectives.items()})
    total = plan_cost(plan, shape, isolated)["total_s"]
    compute = plan_cost(plan, shape, no_comm)["total_s"]
    n_calls = 0
    for step, held in walk(plan, shape):
        load, _ = step_load(step, shape, held)
        n_calls += calls(load.forward, load) + calls(load.backward, load)
    return np.array([total - compute, compute, 3.0 * len(plan.steps), n_calls])


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


def evaluate(runs: list, profile: Profile, fit_names: set) -> dict:
    """Fit the layer terms on fit_names' runs; predict and score the others."""
    samples = []
    for run in runs:
        shape = layer_shape(run["config"])
        for name in SCHEDULES:
            seconds = measured_s(run["schedules"].get(name, {}))
            if seconds is not None:
                samples.append((run["name"], name, shape, seconds))
    fit_rows = [(parts(n, shape, profile), s) for cfg, n, shape, s in samples
                if cfg in fit_names]
    if len(fit_rows) < len(LAYER_KEYS):
        raise ValueError(f"{len(fit_rows)} measured schedules to fit {len(LAYER_KEYS)} layer "
                         "terms on: measure more configurations (a larger --limit)")
    terms = fit_layer_terms([f for f, _ in fit_rows], [s for _, s in fit_rows])
    fitted = replace(profile, layer=terms)

    configs = []
    for run in runs:
        if run["name"] in fit_names:
            continue
        shape = layer_shape(run["config"])
        row = {"name": run["name"], "config": run["config"], "schedules": {}}
        for name in SCHEDULES:
            seconds = measured_s(run["schedules"].get(name, {}))
            if seconds is None:
                row["schedules"][name] = {"measured_s": None, "predicted_s": None,
                                          "reason": run["schedules"].get(name, {}).get("reason")}
                continue
            predicted = plan_cost(shape_plan(name, shape), shape,
                                  fitted)["total_s"]
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
        configs.append(row)

    errors = [abs(s["rel_error"]) for row in configs for s in row["schedules"].values()
              if s["measured_s"] is not None]
    decided = [row for row in configs if row["margin"] is not None and row["margin"] > MARGIN]
    right = sum(row["auto_right"] for row in decided)
    summary = {
        "fit_configs": sorted(fit_names), "held_out_configs": len(configs),
        "layer_terms": dict(zip(LAYER_KEYS, terms)),
        "median_abs_rel_error": statistics.median(errors) if errors else None,
        "p90_abs_rel_error": float(np.percentile(errors, 90)) if errors else None,
        "schedules_compared": len(errors),
        "decisive_configs": len(decided), "auto_right_on_decisive": right,
        "auto_right_share": right / len(decided) if decided else None,
        "auto_right_all": sum(row["auto_right"] for row in configs),
    }
    return {"summary": summary, "configs": configs, "profile": fitted}


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
        f"layer terms fitted on {len(s['fit_configs'])} other configurations: collectives x"
        f"{t['comm_factor']:.2f}, compute x{t['compute_factor']:.2f}, host "
        f"{t['host_s_per_step'] * 1e3:.3f} ms per plan step (backward twice), "
        f"{t['s_per_call'] * 1e3:.3f} ms per collective call",
        f"held out: {s['held_out_configs']} configurations, {s['schedules_compared']} measured "
        f"schedules; median |predicted - measured| / measured = "
        f"{s['median_abs_rel_error']:.1%} (90th percentile {s['p90_abs_rel_error']:.1%})",
        f"auto picked the measured-faster of s1/s2 in {s['auto_right_on_decisive']} of "
        f"{s['decisive_configs']} configurations where it wins by more than {MARGIN:.0%}"
        + (f" ({s['auto_right_share']:.0%})" if s["auto_right_share"] is not None else "")
        + f"; {s['auto_right_all']} of {s['held_out_configs']} overall",
    ]
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
    add_node_flags(p)
    args = p.parse_args(argv)
    if args.nodes < 1 or args.nproc % args.nodes:
        p.error(f"--nproc {args.nproc} must be a multiple of --nodes {args.nodes}")
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

    layouts = node_layouts(args.nproc // args.nodes) if args.nodes > 1 else LAYOUTS
    configs = grid(layouts)[:args.limit]
    names = [f"c{i:02d}" for i in range(len(configs))]
    fit_names = {n for i, n in enumerate(names) if i % 4 == 0}
    if args.bench_json:
        rounds = args.bench_json.split(",")
    else:
        timing = ["--iters", str(args.iters), "--warmup", str(args.warmup)]
        # grouped by layout: each change of layout rebuilds the process groups
        ordered = sorted(zip(names, configs), key=lambda nc: layouts.index(nc[1][0]))
        rounds = []
        for r in range(args.rounds):
            # every other round in the opposite order, so a drift of the machine's speed
            # during the run does not favour the schedules or configurations measured first
            entries = ordered if r % 2 == 0 else ordered[::-1]
            with open(out(f"configs_{r}.json"), "w") as f:
                json.dump([{"name": n, "argv": config_argv(*c) + timing} for n, c in entries],
                          f, indent=1)
            rounds.append(out(f"bench_{r}.json"))
            _run(_tool(args, "bench_moe_layer.py", "--configs", out(f"configs_{r}.json"),
                       "--json", rounds[-1]), f"bench_moe_layer round {r + 1}")
    runs = merge_rounds(rounds)

    try:
        result = evaluate(runs, profile, fit_names)
    except ValueError as error:  # too few fit configurations (a small --limit)
        raise SystemExit(f"validate_cost_model: {error}") from None
    result["profile"].to_json(out("profile.json"))
    print(format_report(result))
    with open(out("validation.json"), "w") as f:
        json.dump({"summary": result["summary"], "configs": result["configs"],
                   "profile": json.loads(result["profile"].to_json())}, f, indent=1)
    print(f"wrote {out('validation.json')}, {out('profile.json')} (fitted profile), "
          f"{write_png(result, out('validation.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
