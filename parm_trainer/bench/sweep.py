"""bench_sweep's grid of MoE layer configurations and what it makes of bench_moe_layer's runs
of it: per configuration the best Parm row, its time over deepspeed-ted's, over the best
megatron-core dispatcher's and over its own link floor, the fastest row; the markdown table and
the plots (tools/bench_sweep.py writes them).
"""

from __future__ import annotations

import os
import statistics

from parm_trainer.bench.results import KINDS, fmt, total_ms

PARM = ("s1", "s2", "auto")
MEGATRON = ("megatron-alltoall", "megatron-allgather")
ROWS = ("baseline", *PARM, *MEGATRON, "deepspeed-ep", "deepspeed-dedup", "deepspeed-ted")

# (world, MP, EP, ESP) and (tokens per MP group as seq x micro-batch, hidden, ffn, experts,
# top-k, capacity factor or None).
LAYOUTS = [(2, 2, 1, 2), (2, 2, 2, 1), (4, 2, 2, 2), (4, 2, 2, 1), (4, 4, 1, 4), (4, 1, 4, 1),
           (8, 2, 4, 2), (8, 4, 2, 4)]
SHAPES = [((128, 4), 128, 256, 4, 2, None), ((256, 4), 256, 512, 8, 2, None),
          ((128, 8), 128, 512, 8, 3, None), ((256, 2), 256, 256, 4, 2, 1.0)]


def grid() -> list:
    """(name, world, argv) for every layout x shape: 32 configurations."""
    out = []
    for world, mp, ep, esp in LAYOUTS:
        for (seq, mbs), hidden, ffn, experts, topk, factor in SHAPES:
            argv = ["--tensor-model-parallel-size", str(mp), "--expert-model-parallel-size",
                    str(ep), "--expert-tensor-parallel-size", str(esp), "--seq-length", str(seq),
                    "--micro-batch-size", str(mbs), "--hidden-size", str(hidden),
                    "--moe-ffn-hidden-size", str(ffn), "--num-experts", str(experts),
                    "--moe-router-topk", str(topk), "--num-attention-heads", "4"]
            if factor is not None:
                argv += ["--moe-expert-capacity-factor", str(factor)]
            if mp > 1:
                argv.append("--sequence-parallel")
            name = (f"w{world}-mp{mp}ep{ep}esp{esp}-n{seq * mbs}-m{hidden}-e{experts}k{topk}"
                    f"{'-f' + str(factor) if factor else ''}")
            out.append((name, world, argv))
    return out


def summarise(runs: list) -> dict:
    """Per configuration: the best Parm row, its time over deepspeed-ted's, over the best
    megatron dispatcher's and over its link floor, and the fastest row; then min / median /
    max of the three ratios. The floor is the best Parm row's own link_floor_ms (its bytes
    leaving the busiest node over the link rate; None on one node), not the smallest of the
    Parm rows': each schedule sends its own bytes, so a floor bounds only its own row's time,
    and the ratio is that row's "x floor" in bench_moe_layer's table."""
    rows, to_ted, to_megatron, to_floor = [], [], [], []
    for run in runs:
        times = {name: total_ms(run["schedules"].get(name)) for name in ROWS}
        ok = {name: t for name, t in times.items() if t is not None}
        parm = {n: ok[n] for n in PARM if n in ok}
        best_parm = min(parm, key=parm.get) if parm else None
        megatron = [ok[n] for n in MEGATRON if n in ok]
        floor = run["schedules"][best_parm].get("link_floor_ms") if best_parm else None
        row = {"name": run["name"], "times": times, "best_parm": best_parm,
               "fastest": min(ok, key=ok.get) if ok else None,
               "parm_over_ted": parm[best_parm] / ok["deepspeed-ted"]
               if best_parm and "deepspeed-ted" in ok else None,
               "parm_over_megatron": parm[best_parm] / min(megatron)
               if best_parm and megatron else None,
               "floor_ms": floor, "parm_over_floor": parm[best_parm] / floor if floor else None}
        rows.append(row)
        if row["parm_over_ted"] is not None:
            to_ted.append(row["parm_over_ted"])
        if row["parm_over_megatron"] is not None:
            to_megatron.append(row["parm_over_megatron"])
        if row["parm_over_floor"] is not None:
            to_floor.append(row["parm_over_floor"])

    def spread(values):
        return None if not values else {"min": min(values), "median": statistics.median(values),
                                        "max": max(values), "configs": len(values)}

    wins = {}
    for row in rows:
        if row["fastest"]:
            wins[row["fastest"]] = wins.get(row["fastest"], 0) + 1
    return {"configs": rows, "parm_over_ted": spread(to_ted),
            "parm_over_megatron": spread(to_megatron), "parm_over_floor": spread(to_floor),
            "fastest_counts": wins}


def markdown(summary: dict) -> str:
    head = ("| configuration | " + " | ".join(ROWS) +
            " | best Parm / ted | best Parm / megatron | floor ms | best Parm / floor |")
    lines = [head, "|" + "---|" * (len(ROWS) + 5)]
    for row in summary["configs"]:
        ted = row["times"].get("deepspeed-ted")
        cells = []
        for name in ROWS:
            t = row["times"][name]
            cells.append("-" if t is None else f"{t:.1f}" + (f" ({t / ted:.2f})" if ted else ""))
        ratios = (fmt(row["parm_over_ted"], ".2f"), fmt(row["parm_over_megatron"], ".2f"),
                  fmt(row["floor_ms"], ".1f"), fmt(row["parm_over_floor"], ".2f"))
        lines.append(f"| {row['name']} | " + " | ".join((*cells, *ratios)) + " |")
    lines.append("")
    lines.append("forward + backward ms (max over ranks), in brackets over deepspeed-ted's; "
                 "- : the row cannot run the layout (sweep.json says why) or is not installed; "
                 "floor ms: the best Parm row's bytes leaving the busiest node over "
                 "--inter-node-bandwidth (- on one node)")
    return "\n".join(lines)


def plots(runs: list, summary: dict, out_dir: str) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [row["name"] for row in summary["configs"]]
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.45), 5))
    width = 0.8 / len(ROWS)
    for i, schedule in enumerate(ROWS):
        values = []
        for row in summary["configs"]:
            t, ted = row["times"][schedule], row["times"]["deepspeed-ted"]
            values.append(t / ted if t is not None and ted else np.nan)
        ax.bar(np.arange(len(names)) + i * width, values, width, label=schedule)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(names)) + 0.4, names, rotation=90, fontsize=6)
    ax.set_ylabel("fwd + bwd time / deepspeed-ted's")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    paths = [os.path.join(out_dir, "time.png")]
    fig.savefig(paths[0])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.45), 5))
    parm_rows = ("baseline", "s1", "s2")
    width = 0.8 / len(parm_rows)
    for i, schedule in enumerate(parm_rows):
        bottom = np.zeros(len(runs))
        for kind in KINDS:
            values = []
            for run in runs:
                b = run["schedules"].get(schedule, {}).get("bytes")
                values.append(0 if not b else max(f + w for f, w in zip(b["forward"][kind],
                                                                         b["backward"][kind])))
            values = np.array(values) / 2 ** 20
            ax.bar(np.arange(len(runs)) + i * width, values, width, bottom=bottom,
                   label=f"{schedule} {kind}" if i == 0 or kind == KINDS[0] else None)
            bottom += values
    ax.set_xticks(np.arange(len(names)) + 0.4, names, rotation=90, fontsize=6)
    ax.set_ylabel("MiB sent per rank (max), fwd + bwd; bars: baseline, s1, s2")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bytes.png"))
    fig.savefig(paths[1])
    plt.close(fig)
    return paths
