"""calibrate_comm's result: the fits of every kind and link class (a link with no measurement
of its own copied from the other), the compute and memory rates, written as a cost Profile JSON
(with the fits and their points under "fit") and printed as a table.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from parm_trainer.bench.calibration.fit import R2_MIN, fit
from parm_trainer.bench.calibration.waits import BURST_PAUSE, burst_from
from parm_trainer.moe.cost_profile import KINDS, LAYER_DEFAULT, LINKS, Profile
from parm_trainer.moe.link_sharing import links_from


def report(args, backend, world, per_node, hosts, measured, local, shares, remote) -> int:
    fits = {link: {k: fit(points) for k, points in pts.items()}
            for link, (_, pts) in measured.items()}
    notes = [f"measured by tools/calibrate_comm.py: {backend}, world {world}, "
             f"{per_node} ranks per node" + (f" ({hosts} host(s) by LOCAL_WORLD_SIZE)"
                                             if hosts else ""),
             f"sizes {args.sizes} bytes per rank, median of {args.repeats} after "
             f"{args.warmup} warm-up; compute and memory fitted on GEMMs and on row "
             "permutations and GELUs run on every rank at once"]
    for link in LINKS:
        if link not in fits:
            other = "intra" if link == "inter" else "inter"
            kind = "multi-node" if link == "inter" else "intra-node"
            notes.append(f"'{link}' not measured (no {kind} group): copied from '{other}'")
    if hosts == 1 and "inter" in measured:
        notes.append(f"one host: 'inter' groups (--gpus-per-node {per_node}) did not cross a "
                     "network")

    collectives, extra, bad = {}, {}, []
    for kind in KINDS:
        collectives[kind], extra[kind] = {}, {}
        for link in LINKS:
            src = link if link in fits else ("intra" if link == "inter" else "inter")
            alpha, beta, r2, clamped = fits[src][kind]
            # the model prices an inter-node AlltoAll per byte that crosses (Profile.price):
            # where some measured peers shared a node, the fitted beta per byte sent is more
            share = remote[src] if kind == "alltoall" and link == src == "inter" else 1.0
            collectives[kind][link] = (alpha, beta / share)
            extra[kind][link] = {"alpha_us": alpha * 1e6, "GBps": 1.0 / beta / 1e9, "r2": r2,
                                 "node_link_GBps": shares[src] / beta / 1e9 if src == "inter"
                                 and link == "inter" else None,
                                 "clamped": clamped, "measured": src == link,
                                 "group_size": measured[src][0],
                                 "points": [[b, s] for b, s in measured[src][1][kind]]}
    local_fits = {name: fit(local[name], relative=name == "memory")
                  for name in ("compute", "memory")}
    inter_flows, flow_points = local.get("link_sharing", (1, []))
    node_links, flow_fits = None, []
    if flow_points:
        flow_fits = [(flows, fit(points)) for flows, points in flow_points]
        (low, low_fit), (high, high_fit) = flow_fits
        node_links = round(links_from(low, low_fit[1], high, high_fit[1]), 2)
    concurrency = tuple((k, round(f, 3)) for k, f in local.get("concurrency", ()))
    waits = [wait for _, wait in local.get("sync_wait", ())]
    per_call = statistics.median(waits) if waits else 0.0
    burst = burst_from(local.get("burst", ()))
    # gloo gives each process group two worker threads (ProcessGroupGloo's default), so two
    # started collectives of one group run at once; NCCL runs them in order on its stream
    profile = Profile(gpus_per_node=per_node, collectives=collectives,
                      lanes=2 if backend == "gloo" else 1, node_links=node_links,
                      inter_flows=max(1, inter_flows), compute_concurrency=concurrency,
                      burst_bytes=round(burst),
                      compute=local_fits["compute"][:2], memory=local_fits["memory"][:2],
                      layer=(*LAYER_DEFAULT[:3], per_call),
                      name=args.name, description="; ".join(notes), world_size=world)
    data = json.loads(profile.to_json())
    for name, (alpha, beta, r2, clamped) in local_fits.items():
        rate = ("TFLOPs", 1e12) if name == "compute" else ("GBps", 1e9)
        extra[name] = {"alpha_us": alpha * 1e6, rate[0]: 1.0 / beta / rate[1], "r2": r2,
                       "clamped": clamped, "points": [list(p) for p in local[name]]}
    extra["link_sharing"] = [{"flows_per_node": flows, "GBps": 1.0 / f[1] / 1e9, "r2": f[2],
                               "points": flow_points[i][1]}
                              for i, (flows, f) in enumerate(flow_fits)]
    extra["sync_wait"] = [list(p) for p in local.get("sync_wait", ())]
    extra["burst"] = [list(p) for p in local.get("burst", ())]
    data["fit"] = extra
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    with open(args.output, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")

    print(f"{'kind':<14}{'link':<7}{'ranks':>6}{'alpha (us)':>12}{'GB/s':>12}{'r^2':>8}"
          f"{'node link GB/s':>16}")
    for link in LINKS:
        if link not in fits:
            continue
        for kind in KINDS:
            alpha, beta, r2, clamped = fits[link][kind]
            flag = " clamped" if clamped else ""
            node = (f"{shares[link] / beta / 1e9:>16.4g}" if link == "inter" and hosts
                    and hosts > 1 else f"{'-':>16}")
            print(f"{kind:<14}{link:<7}{measured[link][0]:>6}{alpha * 1e6:>12.2f}"
                  f"{1.0 / beta / 1e9:>12.4g}{r2:>8.3f}{node}{flag}")
            if r2 < R2_MIN:
                bad.append(f"{kind}/{link} r^2={r2:.3f}")
    for name, (alpha, beta, r2, clamped) in local_fits.items():
        flag = " clamped" if clamped else ""
        unit = "TFLOP/s" if name == "compute" else "GB/s moved"
        rate = 1.0 / beta / (1e12 if name == "compute" else 1e9)
        print(f"{name:<14}{'-':<7}{world:>6}{alpha * 1e6:>12.2f}{rate:>12.4g}{r2:>8.3f}{flag}"
              f"   ({unit})")
        if r2 < R2_MIN:
            bad.append(f"{name} r^2={r2:.3f}")
    for flows, f in flow_fits:
        print(f"{'allreduce':<14}{'inter':<7}{2:>6}{f[0] * 1e6:>12.2f}{1.0 / f[1] / 1e9:>12.4g}"
              f"{f[2]:>8.3f}   ({flows} flow(s) per node link)")
    if node_links is not None:
        print(f"node links: {node_links:g} flows at full rate (the 'inter' rates were measured "
              f"with {inter_flows} per node)")
    if concurrency:
        print("compute time with k ranks computing at once, over all at once: "
              + ", ".join(f"k={k}: {f:.2f}" for k, f in concurrency))
    if waits:
        stretches = [c for c, _ in local["sync_wait"]]
        print(f"a collective after compute waits {per_call * 1e3:.2f} ms more than one after a "
              f"barrier (median over {len(waits)} calls after {min(stretches) * 1e3:.1f} to "
              f"{max(stretches) * 1e3:.1f} ms of compute): the layer's s_per_call")
    if local.get("burst"):
        print(f"the node link passes {burst / 1024:.0f} KiB at once after a pause (sends of "
              f"{local['burst'][0][0] // 1024}-{local['burst'][-1][0] // 1024} KiB timed back to "
              f"back and after {BURST_PAUSE * 1e3:.0f} ms of quiet): the planner's P2P between "
              "stages gets it")
    for note in notes[2:]:
        print(f"note: {note}")
    print(f"wrote {args.output}")
    if bad:
        message = f"calibrate_comm: fit r^2 below {R2_MIN}: {', '.join(bad)}"
        if args.require_r2:
            print(message, file=sys.stderr)
            return 1
        print(f"warning: {message[len('calibrate_comm: '):]} (more --repeats or a wider "
              "--sizes range may help)", file=sys.stderr)
    return 0
