"""Pictures of a training run, drawn from its tensorboard scalars (tools/plot_run.py).

    scalars = read_scalars("runs/demo/tensorboard")     # {tag: [(iteration, value), ...]}
    paths = plot_run(scalars, "runs/demo/plots")        # the PNGs written

- loss.png: training and validation LM loss against the iteration;
- throughput.png: tokens/s (and peak memory per rank, where logged);
- expert_load.png: per MoE layer, each expert's share of the layer's tokens over the run (a
  heatmap; an even load is 1/E everywhere);
- step_times.png (with --timing-log-level 1 or 2): the iteration's time split into
  forward-backward, gradient sync, optimizer and data; at level 2 also each MoE layer's plan
  steps, forward and backward, with the time spent waiting on the exchange's collectives
  hatched.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

from parm_trainer.moe import step_timing

EXPERT_TAG = re.compile(r"^train/tokens_per_expert/layer(\d+)/expert(\d+)$")
MOE_STEP_TAG = re.compile(r"^time_ms/moe/layer(\d+)/(.+)-(fwd|bwd)(-wait)?$")
ITERATION_TIMERS = ("forward-backward", "all-grads-sync", "optimizer", "batch-generator")


class RunDataError(ValueError):
    """The run folder holds nothing to plot; the message says what is missing."""


def read_scalars(tensorboard_dir: str) -> dict:
    """Every scalar of the event files under tensorboard_dir: {tag: [(step, value)]}, by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(tensorboard_dir):
        raise RunDataError(f"no tensorboard folder {tensorboard_dir} (train with "
                           "--tensorboard-dir, as scripts/train_gpt_moe.sh does)")
    files = [os.path.join(root, name) for root, _, names in os.walk(tensorboard_dir)
             for name in names if name.startswith("events.out.tfevents")]
    if not files:
        raise RunDataError(f"no tensorboard event files under {tensorboard_dir}")
    scalars = defaultdict(dict)
    for path in sorted(files):  # a resumed run writes a second file; later values win
        events = EventAccumulator(path, size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            for event in events.Scalars(tag):
                scalars[tag][event.step] = event.value
    return {tag: sorted(points.items()) for tag, points in scalars.items()}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_loss(scalars: dict, path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    for tag, label, style in (("train/lm loss", "training", "-"),
                              ("valid/lm loss", "validation", "o-")):
        if scalars.get(tag):
            steps, values = zip(*scalars[tag])
            ax.plot(steps, values, style, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("LM loss (cross entropy, nats per token)")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_throughput(scalars: dict, path: str) -> str:
    plt = _pyplot()
    memory = scalars.get("train/peak_memory_mib")
    fig, axes = plt.subplots(2 if memory else 1, 1, figsize=(7, 6 if memory else 3.5),
                             squeeze=False, layout="constrained")
    steps, values = zip(*scalars["train/tokens_per_s"])
    axes[0][0].plot(steps, values, "-o", markersize=3)
    axes[0][0].set_ylabel("tokens/s (whole job)")
    axes[0][0].set_title("Training throughput (mean over each log interval)")
    if memory:
        steps, values = zip(*memory)
        axes[1][0].plot(steps, values, "-", color="tab:red")
        axes[1][0].set_ylabel("peak memory per rank (MiB)")
        axes[1][0].set_title("Peak memory, max over ranks")
    for (ax,) in axes:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def expert_load(scalars: dict) -> dict:
    """{layer: (iterations, shares)}: shares[i][e] is expert e's share of layer's tokens in the
    log interval ending at iterations[i]."""
    counts = defaultdict(dict)  # layer -> expert -> [(step, tokens)]
    for tag, points in scalars.items():
        match = EXPERT_TAG.match(tag)
        if match:
            counts[int(match.group(1))][int(match.group(2))] = dict(points)
    out = {}
    for layer, experts in sorted(counts.items()):
        steps = sorted(set.intersection(*(set(p) for p in experts.values())))
        width = max(experts) + 1
        rows = []
        for step in steps:
            row = [experts.get(e, {}).get(step, 0.0) for e in range(width)]
            total = sum(row)
            rows.append([v / total if total else 0.0 for v in row])
        out[layer] = (steps, rows)
    return out


def plot_expert_load(scalars: dict, path: str) -> str:
    load = expert_load(scalars)
    plt = _pyplot()
    fig, axes = plt.subplots(len(load), 1, figsize=(7.5, 1.4 + 1.5 * len(load)), squeeze=False,
                             sharex=True, layout="constrained")
    experts = max(len(rows[0]) for _, rows in load.values())
    for (ax,), (layer, (steps, rows)) in zip(axes, load.items()):
        # a cell per log interval: (previous logged iteration, this one]
        image = ax.pcolormesh([0] + steps, [e - 0.5 for e in range(len(rows[0]) + 1)],
                              [list(col) for col in zip(*rows)], cmap="viridis", vmin=0.0,
                              vmax=min(1.0, 3.0 / experts))
        ax.set_yticks(range(len(rows[0])))
        ax.invert_yaxis()
        ax.set_ylabel(f"layer {layer}\nexpert")
    fig.colorbar(image, ax=[ax for (ax,) in axes],
                 label=f"share of the layer's tokens (even load: {1 / experts:.2f})")
    axes[-1][0].set_xlabel("iteration (each cell: one log interval)")
    axes[0][0].set_title("Expert load: each expert's share of its layer's tokens")
    return _save(fig, path)


def _mean_after_first(points):
    values = [v for _, v in points]
    return sum(values[1:]) / (len(values) - 1) if len(values) > 1 else values[0]


def step_breakdown(scalars: dict):
    """(iteration timers {name: mean ms}, MoE steps {layer: {step: {fwd, bwd, fwd-wait,
    bwd-wait}}}), each the mean over the log intervals after the first (start-up)."""
    iteration = {name: _mean_after_first(scalars[f"time_ms/{name}"])
                 for name in ITERATION_TIMERS if scalars.get(f"time_ms/{name}")}
    moe = defaultdict(lambda: defaultdict(dict))
    for tag, points in scalars.items():
        match = MOE_STEP_TAG.match(tag)
        if match:
            layer, step, direction, wait = match.groups()
            moe[int(layer)][step][direction + (wait or "")] = _mean_after_first(points)
    return iteration, {layer: dict(steps) for layer, steps in sorted(moe.items())}


def plot_step_times(scalars: dict, path: str) -> str:
    iteration, moe = step_breakdown(scalars)
    plt = _pyplot()
    fig, axes = plt.subplots(2 if moe else 1, 1, squeeze=False, layout="constrained",
                             figsize=(9, 3 + (0.6 * len(moe) + 2.5 if moe else 0)))
    ax = axes[0][0]
    names = list(iteration)
    ax.barh(range(len(names)), [iteration[n] for n in names], color="tab:blue")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("ms per iteration (max over ranks)")
    ax.set_title("Where an iteration's time goes")
    if moe:
        ax = axes[1][0]
        steps = step_timing.plan_order({s for layer in moe.values() for s in layer})
        colors = dict(zip(steps, plt.cm.tab10.colors))
        labels = []
        for row, (layer, times) in enumerate(moe.items()):
            for col, direction in enumerate(("fwd", "bwd")):
                y, left = 2 * row + col, 0.0
                for step in steps:
                    ms = times.get(step, {}).get(direction, 0.0)
                    wait = min(ms, times.get(step, {}).get(direction + "-wait", 0.0))
                    label = step if row == 0 and col == 0 else None
                    ax.barh(y, ms - wait, left=left, color=colors[step], label=label)
                    ax.barh(y, wait, left=left + ms - wait, color=colors[step], hatch="///",
                            edgecolor="white")
                    left += ms
                labels.append(f"layer {layer} {'forward' if col == 0 else 'backward'}")
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlabel("ms per iteration, all micro-batches (max over ranks)\n"
                      "hatched: waiting on the step's collectives")
        ax.set_title("MoE layer plan steps")
        ax.legend(ncol=len(steps), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    return _save(fig, path)


def plot_run(scalars: dict, out_dir: str) -> list:
    """Every plot the scalars allow, written into out_dir; their paths."""
    if not scalars.get("train/lm loss"):
        raise RunDataError("no training loss in the tensorboard scalars (train/lm loss)")
    os.makedirs(out_dir, exist_ok=True)
    paths = [plot_loss(scalars, os.path.join(out_dir, "loss.png"))]
    if scalars.get("train/tokens_per_s"):
        paths.append(plot_throughput(scalars, os.path.join(out_dir, "throughput.png")))
    if expert_load(scalars):
        paths.append(plot_expert_load(scalars, os.path.join(out_dir, "expert_load.png")))
    if any(tag.startswith("time_ms/") for tag in scalars):
        paths.append(plot_step_times(scalars, os.path.join(out_dir, "step_times.png")))
    return paths
