"""The command line that runs a tool's ranks: on this machine under torchrun, or spread over
emulated nodes by tools/emulated_cluster.py (as root); and the two flags that choose.

    add_node_flags(parser)                  # --nodes, --inter-node-bandwidth
    launch_command(4, args.nodes, args.inter_node_bandwidth, "runs/x/nodes",
                   ["tools/bench_moe_layer.py", "--configs", "c.json"])

Used by tools/validate_cost_model.py, tools/bench_sweep.py and tools/bench_e2e.py.
"""

from __future__ import annotations

import os
import sys

from parm_trainer.launch import torchrun_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EMULATED_CLUSTER = os.path.join(ROOT, "tools", "emulated_cluster.py")


def add_node_flags(parser) -> None:
    """--nodes and --inter-node-bandwidth, for the tools that can spread their ranks over
    emulated nodes (launch_command)."""
    parser.add_argument("--nodes", type=int, default=1,
                        help="spread the ranks over this many emulated nodes (needs root; "
                             "tools/emulated_cluster.py)")
    parser.add_argument("--inter-node-bandwidth", default="200mbit",
                        help="with --nodes > 1: the emulated link rate between nodes")


def launch_command(nproc: int, nodes: int, bandwidth: str, log_dir: str,
                   script_and_args: list) -> list:
    """The command that runs script_and_args as nproc ranks (for other tools): on this
    machine under torchrun, or with nodes > 1, nproc / nodes ranks on each of that many
    emulated nodes, their logs in log_dir."""
    if nodes == 1:
        return [*torchrun_command(), "--standalone", "--nproc-per-node", str(nproc),
                *script_and_args]
    return [sys.executable, EMULATED_CLUSTER, "--nodes", str(nodes), "--procs-per-node",
            str(nproc // nodes), "--inter-node-bandwidth", bandwidth, "--log-dir", log_dir, "--",
            *script_and_args]
