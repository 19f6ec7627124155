"""sudo python tools/emulated_cluster.py --nodes 2 --procs-per-node 2 --inter-node-bandwidth 200mbit -- SCRIPT [ARGS...]

Runs SCRIPT on an emulated multi-node cluster on this one machine, through the project's
multi-node launcher (scripts/launch.sh, torchrun), exactly as on a real cluster:

- every node is a Linux network namespace with its own loopback (its ranks talk over it, at
  memory speed) and one veth link to a bridge that joins the nodes;
- each node's egress on that link is shaped with a tbf qdisc to --inter-node-bandwidth, so
  traffic between nodes flows at cluster-like rates (an optional --inter-node-latency needs the
  kernel's netem qdisc and is refused where it is missing);
- TCP in every node runs reno without slow start after idle: a collective's flows then fill the
  shaped rate from their first byte, as a cluster link does. (This machine's default, BBR, paces
  by its own estimate of the bottleneck, which tbf's queue misleads: calls of a 2 MiB AlltoAll
  ran at 14-20 MB/s on a 25 MB/s link, and the same call varied by 40 % from one to the next;
  with reno, back-to-back calls run at 22-24 MB/s, i.e. the rate less TCP/IP headers.)
- node i gets 198.18.0.(i+1)/24 (198.18.0.0/15 is reserved for network benchmarks, RFC 2544);
  node 0 is the master. Its launcher runs with NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR,
  MASTER_PORT and GLOO_SOCKET_IFNAME (the node's veth) set, so gloo binds to the emulated
  network and nothing leaves the namespaces.

To test what a job does when a node's link fails mid-run, --fail-link-after S (seconds after
the launch) or --fail-link-at TEXT (when a node's output first shows TEXT, for example
"iteration      4/") takes the last node's link down (--fail-node picks another); the link
stays down until the cluster is removed. --stop-node-after and --stop-node-at stop that node's
ranks instead (SIGSTOP, as a hung host or a debugger would).

Node 0's output (ranks 0 .. P-1) streams to this terminal; every node's output is kept in
--log-dir/node<i>.log. The exit status is the first failing node's (0 when all succeed); when a
node fails, the others get --grace seconds to notice, then are stopped. Everything created
(namespaces, links, bridge) is removed on exit, also after a failure or Ctrl-C.

Needs root and iproute2 (`ip netns`, `tc`); anything else is refused with a message. Examples:

    # calibrate intra- and inter-node collectives (LOCAL_WORLD_SIZE tells it the node size)
    python tools/emulated_cluster.py --nodes 2 --procs-per-node 2 --inter-node-bandwidth 200mbit \\
        -- tools/calibrate_comm.py --output runs/emulated/profile.json
    # the MoE layer benchmark with MP inside a node and EP across nodes
    python tools/emulated_cluster.py --nodes 2 --procs-per-node 2 --inter-node-bandwidth 200mbit \\
        -- tools/bench_moe_layer.py --tensor-model-parallel-size 2 --expert-model-parallel-size 2 ...
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from parm_trainer.cluster.netns import (DELAY, RATE, Cluster, check_host, parse_with_command,
                                       run_guarded)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def node_env(cluster: Cluster, node: int, procs: int, port: int) -> dict:
    env = dict(os.environ)
    env.update(NNODES=str(cluster.nodes), NODE_RANK=str(node), NPROC_PER_NODE=str(procs),
               MASTER_ADDR=cluster.address(0), MASTER_PORT=str(port),
               GLOO_SOCKET_IFNAME=cluster.device(node), NCCL_SOCKET_IFNAME=cluster.device(node),
               PYTHON=env.get("PYTHON", sys.executable), PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _pump(stream, log, echo, link_fault=None) -> None:
    """Copy a node's output to its log (and the terminal); a line showing link_fault's text
    takes the link down at once."""
    for line in iter(stream.readline, ""):
        log.write(line)
        log.flush()
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()
        if link_fault and link_fault.text and link_fault.text in line:
            link_fault.cut()


class LinkFault:
    """Takes a node's link down once (or, stop=True, stops its ranks with SIGSTOP): after
    seconds, or when a node's output shows text."""

    def __init__(self, cluster: "Cluster", node: int, after_s: float | None = None,
                 text: str | None = None, stop: bool = False):
        self.cluster, self.node, self.after_s, self.text = cluster, node, after_s, text
        self.stop, self.launchers = stop, []  # run_on_cluster's per-node processes
        self.lock, self.done, self.started = threading.Lock(), False, time.monotonic()

    def cut(self) -> None:
        with self.lock:
            if self.done:
                return
            what = self._stop_ranks() if self.stop else self.cluster.cut_link(self.node)
            self.done = True
        what = what if self.stop else f"took node {self.node}'s link down"
        print(f"emulated_cluster: {what} {time.monotonic() - self.started:.1f} s after the "
              f"launch", flush=True)

    def _stop_ranks(self) -> str:
        """SIGSTOP every rank of the node and what it started (LOCAL_RANK set), as a hung host."""
        import psutil

        ranks = []
        for process in psutil.Process(self.launchers[self.node].pid).children(recursive=True):
            try:
                if "LOCAL_RANK" in process.environ():
                    process.suspend()
                    ranks.append(int(process.environ()["RANK"]))
            except psutil.Error:
                pass
        return f"stopped node {self.node}'s ranks {sorted(set(ranks))} (SIGSTOP)"

    def poll(self) -> None:
        if self.after_s is not None and time.monotonic() - self.started >= self.after_s:
            self.cut()


def run_on_cluster(cluster: Cluster, procs: int, command: list, log_dir: str, port: int,
                   grace: float, link_fault: LinkFault | None = None) -> int:
    os.makedirs(log_dir, exist_ok=True)
    launcher = ["bash", os.path.join(ROOT, "scripts", "launch.sh"), *command]
    children, pumps, logs = [], [], []
    for node, ns in enumerate(cluster.namespaces):
        logs.append(open(os.path.join(log_dir, f"node{node}.log"), "w"))
        child = subprocess.Popen(["ip", "netns", "exec", ns, *launcher], cwd=ROOT,
                                 env=node_env(cluster, node, procs, port), text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        children.append(child)
        if link_fault:
            link_fault.launchers = children
        pump = threading.Thread(target=_pump, args=(child.stdout, logs[-1], node == 0,
                                                    link_fault), daemon=True)
        pump.start()
        pumps.append(pump)
    failures, stopped, first_failure = [], set(), None  # (node, status) in order of failing
    try:
        while any(c.poll() is None for c in children):
            if link_fault:
                link_fault.poll()
            for node, c in enumerate(children):
                if c.poll() not in (None, 0) and node not in dict(failures):
                    failures.append((node, c.returncode))
                    first_failure = first_failure or time.monotonic()
            if first_failure and time.monotonic() - first_failure > grace:
                for node, c in enumerate(children):
                    if c.poll() is None:
                        stopped.add(node)
                        os.killpg(c.pid, signal.SIGTERM)
                break
            time.sleep(0.2)
        for c in children:
            try:
                c.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(c.pid, signal.SIGKILL)
                c.wait()
        for pump in pumps:
            pump.join(timeout=5)
    finally:
        for c in children:
            if c.poll() is None:
                os.killpg(c.pid, signal.SIGKILL)
        for log in logs:
            log.close()
    for node, c in enumerate(children):
        if c.returncode != 0 and node not in dict(failures) and node not in stopped:
            failures.append((node, c.returncode))
    for node, code in failures:
        print(f"emulated_cluster: node {node} exited with {code} "
              f"(log {os.path.join(log_dir, f'node{node}.log')})", file=sys.stderr)
    if stopped:
        print(f"emulated_cluster: stopped node(s) {sorted(stopped)} {grace:g} s after the first "
              "failure", file=sys.stderr)
    if not failures:
        return 0
    code = failures[0][1]
    return code if code > 0 else 128 - code


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [options] -- SCRIPT [ARGS...]")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--procs-per-node", type=int, default=2)
    p.add_argument("--inter-node-bandwidth", default="200mbit",
                   help="tc rate of every node's egress, e.g. 200mbit, 1gbit (default 200mbit)")
    p.add_argument("--inter-node-latency", default=None,
                   help="added one-way delay, e.g. 1ms (needs netem)")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--log-dir", default="runs/emulated_cluster")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds the other nodes get to exit after one fails")
    p.add_argument("--fail-link-after", type=float, default=None, metavar="S",
                   help="take a node's link down S seconds after the launch")
    p.add_argument("--fail-link-at", default=None, metavar="TEXT",
                   help="take a node's link down when a node's output first shows TEXT")
    p.add_argument("--stop-node-after", type=float, default=None, metavar="S",
                   help="stop a node's ranks (SIGSTOP) S seconds after the launch")
    p.add_argument("--stop-node-at", default=None, metavar="TEXT",
                   help="stop a node's ranks (SIGSTOP) when a node's output first shows TEXT")
    p.add_argument("--fail-node", type=int, default=None,
                   help="the node whose link fails or whose ranks stop (default: the last)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...] after --")
    args = parse_with_command(p, argv, "pretrain_gpt_moe.py --tensor-model-parallel-size 2 ...")
    if args.nodes < 1 or args.procs_per_node < 1:
        p.error("--nodes and --procs-per-node must be at least 1")
    if args.nodes > 250:
        p.error("--nodes: at most 250")
    if not RATE.match(args.inter_node_bandwidth):
        p.error(f"--inter-node-bandwidth {args.inter_node_bandwidth!r}: a tc rate such as "
                "200mbit or 1gbit")
    if args.inter_node_latency and not DELAY.match(args.inter_node_latency):
        p.error(f"--inter-node-latency {args.inter_node_latency!r}: a delay such as 1ms")
    if (args.fail_link_after is not None or args.fail_link_at) and (
            args.stop_node_after is not None or args.stop_node_at):
        p.error("--fail-link-* and --stop-node-*: one fault at a time")
    if args.fail_node is not None and not 0 <= args.fail_node < args.nodes:
        p.error(f"--fail-node {args.fail_node}: a node from 0 to {args.nodes - 1}")
    return args


def main(argv=None) -> int:
    args = parse(argv)

    def body():
        check_host(args.inter_node_latency)
        with Cluster(args.nodes, args.inter_node_bandwidth, args.inter_node_latency) as cluster:
            print(f"emulated_cluster: {args.nodes} nodes x {args.procs_per_node} ranks, "
                  f"{args.inter_node_bandwidth} between nodes"
                  + (f", {args.inter_node_latency} latency" if args.inter_node_latency else "")
                  + f", master {cluster.address(0)}:{args.master_port}; logs in {args.log_dir}",
                  flush=True)
            fault = None
            node = args.nodes - 1 if args.fail_node is None else args.fail_node
            if args.fail_link_after is not None or args.fail_link_at:
                fault = LinkFault(cluster, node, args.fail_link_after, args.fail_link_at)
            elif args.stop_node_after is not None or args.stop_node_at:
                fault = LinkFault(cluster, node, args.stop_node_after, args.stop_node_at,
                                  stop=True)
            return run_on_cluster(cluster, args.procs_per_node, args.command, args.log_dir,
                                  args.master_port, args.grace, fault)

    return run_guarded(body, "emulated_cluster: interrupted; removed the emulated cluster")


if __name__ == "__main__":
    sys.exit(main())
