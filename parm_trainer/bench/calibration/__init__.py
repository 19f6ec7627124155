"""What calibrate_comm measures (tools/calibrate_comm.py's docstring says how and why): every
collective kind on groups placed as a layout's MP, EP and ESP groups are (all at once), the
expert MLP's compute rate and the memory rate of token permutation, each fitted by alpha-beta
least squares (fit.py). report.py turns the fits into a cost Profile.

    collectives.py  the collectives on a layout's groups, per link class
    local.py        the compute and memory rates, compute with fewer ranks at once
    waits.py        the wait at a collective after compute, the burst, link sharing
    fit.py          the alpha-beta fit
    report.py       the profile and its table
"""

from __future__ import annotations

import torch.distributed as dist

from parm_trainer.bench.calibration.collectives import (calibration_groups, measure_groups,
                                                        node_share, remote_peers)
from parm_trainer.bench.calibration.local import (gemm_cases, measure_concurrency, measure_local,
                                                  memory_cases)
from parm_trainer.bench.calibration.waits import (measure_burst, measure_link_sharing,
                                                  measure_sync_wait)


def calibrate(args, device, per_node):
    """Everything calibrate_comm measures, on every rank: (measured {link: (group size,
    {kind: points})}, local {"compute"|"memory": points, "concurrency": [(k, factor)],
    "sync_wait": [(stretch s, wait s)], "burst": [(bytes, sustained s, after a pause s)],
    "link_sharing": (inter flows, [(flows, points)])}, node_share per link, remote_peers per
    link)."""
    from parm_trainer.progress import Progress

    world = dist.get_world_size()
    measured, shares, remote = {}, {}, {}
    links = calibration_groups(world, per_node, args.group_size)
    progress = Progress(len(links) + 6, "calibrate_comm", enabled=dist.get_rank() == 0)
    for link, groups in links.items():
        measured[link] = measure_groups(groups, args, device)
        shares[link], remote[link] = node_share(groups, per_node), remote_peers(groups, per_node)
        progress.done(f"{link} collectives ({len(groups)} group(s) of {len(groups[0])})")
    local = {}
    for name, cases in (("compute", gemm_cases), ("memory", memory_cases)):
        local[name] = measure_local(cases(device), args.repeats, args.warmup, device, args.calls)
        progress.done(f"{name} rate")
    local["concurrency"] = measure_concurrency(max(3, args.repeats // 2), 1, device,
                                               max(1, args.calls // 2))
    progress.done("compute with fewer ranks at once")
    local["sync_wait"] = measure_sync_wait(max(5, args.repeats), 1, device,
                                           max(4, args.calls), per_node)
    progress.done("waits at a collective after compute")
    local["link_sharing"] = (measure_link_sharing(links["inter"], args, device, per_node)
                             if "inter" in links else (1, []))
    progress.done("link sharing (AllReduce with 1 and more flows per node)")
    local["burst"] = measure_burst(max(5, args.repeats), device, per_node)
    progress.done("the link's burst (sends after a pause)")
    return measured, local, shares, remote
