"""Emulated cluster nodes on one machine: network namespaces on a bridge, their links shaped.

Every node is a Linux network namespace with its own loopback and one veth link to a bridge
that joins the nodes; each node's egress on that link is shaped with tbf to a cluster-like
rate, and TCP runs reno without slow start after idle (tools/emulated_cluster.py's docstring
says why). Node i gets 198.18.0.(i+1)/24 (198.18.0.0/15 is reserved for network benchmarks,
RFC 2544) and resolves the others by name (/etc/netns/NS/hosts). Used by
tools/emulated_cluster.py (torchrun on every node) and parm_trainer/cluster/slurm.py (slurm on
every node). Needs root and iproute2.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

SUBNET = "198.18.0"
# per node (see the module docstring); reno is built into every kernel and always allowed
TCP_SETTINGS = ("net.ipv4.tcp_congestion_control=reno", "net.ipv4.tcp_slow_start_after_idle=0")
RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)$", re.I)
DELAY = re.compile(r"^\d+(\.\d+)?(us|ms|s)$", re.I)


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate ("200mbit", "1gbit", "25mbps") in bytes per second (tc's units: bit rates
    and byte rates, decimal prefixes)."""
    number, prefix, unit = RATE.match(rate).groups()
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[prefix.lower()]
    return float(number) * scale / (8 if unit.lower() == "bit" else 1)


class ClusterError(RuntimeError):
    """The emulated cluster cannot be set up here; the message says why."""


def _run(*command, check=True, namespace=None) -> subprocess.CompletedProcess:
    if namespace:
        command = ("ip", "netns", "exec", namespace, *command)
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise ClusterError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")
    return result


def check_host(latency: str | None) -> None:
    """Refuse clearly where namespaces or shaping cannot work."""
    if os.geteuid() != 0:
        raise ClusterError("network namespaces need root: run as root (e.g. with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"`{tool}` (iproute2) is not installed")
    if _run("ip", "netns", "list", check=False).returncode != 0:
        raise ClusterError("`ip netns` does not work on this machine")
    if latency and not _has_netem():
        raise ClusterError(f"--inter-node-latency {latency} needs the kernel's netem qdisc, "
                           "which this kernel lacks; leave the latency out")


def _has_netem() -> bool:
    probe = f"ptnetem{os.getpid() % 100000}"
    try:
        _run("ip", "netns", "add", probe)
        return _run("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                    check=False, namespace=probe).returncode == 0
    finally:
        _run("ip", "netns", "del", probe, check=False)


def run_guarded(body, interrupted: str) -> int:
    """A tool's main: body() under SIGTERM/SIGINT handlers that raise KeyboardInterrupt once
    (a second signal must not cut the teardown short); a ClusterError becomes one `error:`
    line and status 2, an interrupt the line `interrupted` and status 130."""
    def on_signal(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return body()
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130


def parse_with_command(parser, argv, example: str):
    """parser's arguments, the last being "command" (argparse.REMAINDER): the command after
    "--", refused when missing with an example of one."""
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error(f"give the command after --, e.g. -- {example}")
    return args


class TornDown:
    """A context manager that starts in _start and always ends in teardown (also when the
    start fails half way)."""

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()


def default_tag(pid: int) -> str:
    """The prefix of the names a process's cluster gives its namespaces and links (they fit
    Linux's 15 characters)."""
    return f"pt{pid % 100000}"


class Cluster(TornDown):
    """N namespaces on one bridge; use as a context manager (teardown on exit, always)."""

    def __init__(self, nodes: int, rate: str, latency: str | None = None, tag: str | None = None):
        self.nodes, self.rate, self.latency = nodes, rate, latency
        # tbf's bucket: 10 ms of traffic (at least 64 KiB). A bucket smaller than what the rate
        # sends between two timer ticks caps the throughput below the rate (with 64 KiB a
        # 200mbit link carried 17.7 MB/s of AlltoAll; with 250 KB, 23.9 of the 25).
        self.burst = str(max(65536, int(rate_bytes_per_s(rate) / 100)))
        self.tag = tag or default_tag(os.getpid())
        self.bridge = f"{self.tag}br"
        self.namespaces = [f"{self.tag}n{i}" for i in range(nodes)]
        self.created = []  # ("netns" | "link" | "dir", name), in creation order

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def device(self, node: int) -> str:
        return f"{self.tag}v{node}"

    def host_end(self, node: int) -> str:
        """The bridge's end of node's veth link."""
        return f"{self.tag}h{node}"

    def host_address(self) -> str:
        """The bridge's own address (add_host_address): this machine, seen from the nodes."""
        return f"{SUBNET}.254"

    def add_host_address(self) -> None:
        """Give the bridge an address, so that a daemon on this machine (slurmctld) and the
        nodes reach each other; it goes with the bridge."""
        _run("ip", "addr", "add", f"{self.host_address()}/24", "dev", self.bridge)

    def cut_link(self, node: int) -> None:
        """Take node's link to the bridge down: its packets to and from the others are lost."""
        _run("ip", "link", "set", self.host_end(node), "down")

    def _start(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self.created.append(("link", self.bridge))
        _run("ip", "link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(i)} {ns}\n" for i, ns in enumerate(self.namespaces))
        for i, ns in enumerate(self.namespaces):
            # `ip netns exec` shows /etc/netns/NS/hosts as /etc/hosts: the nodes resolve each
            # other's addresses (torch's store looks the peers' names up)
            etc = os.path.join("/etc/netns", ns)
            os.makedirs(etc, exist_ok=True)
            self.created.append(("dir", etc))
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(hosts)
            _run("ip", "netns", "add", ns)
            self.created.append(("netns", ns))
            host_end, node_end = self.host_end(i), self.device(i)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            self.created.append(("link", host_end))
            _run("ip", "link", "set", node_end, "netns", ns)
            _run("ip", "link", "set", host_end, "master", self.bridge)
            _run("ip", "link", "set", host_end, "up")
            _run("ip", "link", "set", "lo", "up", namespace=ns)
            _run("ip", "addr", "add", f"{self.address(i)}/24", "dev", node_end, namespace=ns)
            _run("ip", "link", "set", node_end, "up", namespace=ns)
            _run("sysctl", "-qw", *TCP_SETTINGS, namespace=ns)
            # egress of the node onto the "network": tbf, and netem under it for a latency
            shape = ["tc", "qdisc", "add", "dev", node_end, "root", "handle", "1:", "tbf",
                     "rate", self.rate, "burst", self.burst, "latency", "400ms"]
            _run(*shape, namespace=ns)
            if self.latency:
                _run("tc", "qdisc", "add", "dev", node_end, "parent", "1:1", "handle", "10:",
                     "netem", "delay", self.latency, namespace=ns)

    def teardown(self) -> None:
        """Stop whatever still runs in the namespaces, then remove all this object made."""
        for kind, name in reversed(self.created):
            if kind == "netns":
                pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                _run("ip", "netns", "del", name, check=False)
            elif kind == "dir":
                shutil.rmtree(name, ignore_errors=True)
            else:
                _run("ip", "link", "del", name, check=False)
        self.created.clear()
