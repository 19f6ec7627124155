"""validate_cost_model's grid of MoE layer configurations and its scoring: the measured
rounds merged, the grid dealt into folds, each fold predicted by the layer terms fitted on the
others (cost_fit.py), auto's choice of s1 or s2 and of the pipeline depth against the
measured-fastest. tools/validate_cost_model.py runs the measurements; validation_report.py
prints and plots the result.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import numpy as np

from parm_trainer.bench.cost_fit import fit_plans, layer_shape
from parm_trainer.bench.results import total_ms
from parm_trainer.moe.cost_model import choose_schedule, plan_cost, shape_plan
from parm_trainer.moe.cost_profile import LAYER_KEYS, Profile

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
    ms = total_ms(result)
    return None if ms is None else ms / 1e3


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
