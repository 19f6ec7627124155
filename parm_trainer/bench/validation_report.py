"""validate_cost_model's report: predicted against measured time per configuration and
schedule, the layer terms, the held-out error and auto's choices (format_report), and the
predicted-against-measured plot (write_png)."""

from __future__ import annotations

from parm_trainer.bench.validation import MARGIN, SCHEDULES

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
