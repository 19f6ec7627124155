"""sudo python tools/slurm_cluster.py --nodes 2 --gpus-per-node 2 -- COMMAND [ARGS...]

Runs COMMAND on this machine against a real slurm whose nodes are emulated ones
(parm_trainer/cluster/slurm.py over the namespaces of tools/emulated_cluster.py): slurmctld
here, a slurmd in every node, the nodes idle before COMMAND starts. COMMAND sees SLURM_CONF, so
sbatch, srun, squeue and scontrol reach that slurm, and a batch script runs on the nodes as on
a cluster. Installs slurm and munge with apt-get if they are missing. Everything (daemons,
namespaces, the state directory) is removed afterwards, also after a failure or Ctrl-C. The
exit status is COMMAND's. Needs root. For example, the GPT job on 2 nodes x 2 ranks:

    python tools/slurm_cluster.py --nodes 2 --gpus-per-node 2 -- \\
        sbatch --wait --nodes 2 --gpus-per-node 2 scripts/slurm_gpt_moe.sbatch
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from parm_trainer.cluster.netns import (RATE, Cluster, check_host, parse_with_command,
                                       run_guarded)
from parm_trainer.cluster.slurm import Slurm


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [options] -- COMMAND [ARGS...]")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=2,
                   help="GPUs each node declares to slurm (stand-ins: the ranks run on the CPU)")
    p.add_argument("--inter-node-bandwidth", default="200mbit",
                   help="tc rate of every node's link, e.g. 200mbit, 1gbit (default 200mbit)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="COMMAND [ARGS...] after --")
    args = parse_with_command(p, argv, "sbatch --wait --nodes 2 ...")
    if not 1 <= args.nodes <= 250 or args.gpus_per_node < 0:
        p.error("--nodes: 1 to 250; --gpus-per-node: 0 or more")
    if not RATE.match(args.inter_node_bandwidth):
        p.error(f"--inter-node-bandwidth {args.inter_node_bandwidth!r}: a tc rate such as 200mbit")
    return args


def main(argv=None) -> int:
    args = parse(argv)

    def body():
        check_host(None)
        with Cluster(args.nodes, args.inter_node_bandwidth) as cluster, \
                Slurm(cluster, args.gpus_per_node) as slurm:
            print(f"slurm_cluster: nodes {','.join(slurm.nodes)} idle ({args.gpus_per_node} GPUs,"
                  f" {slurm.cpus} CPUs each, {args.inter_node_bandwidth} between them); "
                  f"SLURM_CONF={slurm.path('slurm.conf')}", flush=True)
            return subprocess.run(args.command, env=slurm.env()).returncode

    return run_guarded(body, "slurm_cluster: interrupted; removed slurm and the emulated nodes")


if __name__ == "__main__":
    sys.exit(main())
