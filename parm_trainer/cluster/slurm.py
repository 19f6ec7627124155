"""A real slurm on emulated nodes: slurmctld on this machine, one slurmd in each node.

Debian's slurm (slurm-wlm 22.05: slurmctld, slurmd, munge) runs unmodified: one munged and one
slurmctld on this machine (the controller listens on the bridge's address, so the nodes reach
it and sbatch, squeue and scontrol work from here), and in every namespace of an emulated
Cluster (netns.py) a slurmd under the node's own name, with its own spool, pid and log files.
Each node declares this machine's CPUs and G GPUs (gres files that stand in for the devices:
there are none, the ranks run on the CPU with gloo), so a batch script asks for what it asks
for on a GPU cluster (--gpus-per-node). Everything lives in one state directory (slurm.conf,
the munge key and socket, the controller's state, the daemons' logs), handed to every client
and daemon as SLURM_CONF; nothing under /etc is touched. Teardown (also after a failure or an
interrupt) stops the daemons and removes the directory; the Cluster removes the namespaces.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from parm_trainer.cluster.netns import Cluster, ClusterError, TornDown

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PACKAGE_OF = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
           "munged": "munge"}
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED")
SLURMD_PORT = 6818  # every slurmd has a network namespace of its own


class SlurmError(ClusterError):
    """slurm cannot be installed or started here; the message says why."""


def ensure_installed() -> None:
    """Install Debian's slurm and munge with apt-get where a daemon is missing (needs root)."""
    missing = sorted({package for command, package in PACKAGE_OF.items()
                      if shutil.which(command) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise SlurmError(f"slurm is not installed ({', '.join(missing)} missing) and there is "
                         "no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    result = subprocess.run(install, capture_output=True, text=True, env=env)
    if result.returncode != 0:  # no package lists yet on a fresh machine
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)
        result = subprocess.run(install, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SlurmError("apt-get could not install slurm: "
                         + (result.stderr.strip().splitlines() or ["(no output)"])[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Slurm(TornDown):
    """slurm on an emulated Cluster; a context manager (teardown on exit, always)."""

    def __init__(self, cluster: Cluster, gpus_per_node: int, cpus_per_node: int | None = None):
        self.cluster, self.gpus = cluster, gpus_per_node
        self.cpus = cpus_per_node or os.cpu_count() or 1
        self.nodes = list(cluster.namespaces)
        self.state = None
        self.port = None
        self.daemons = {}  # name -> Popen

    # --- paths and environment ---------------------------------------------------------------
    def path(self, *parts) -> str:
        return os.path.join(self.state, *parts)

    def env(self, **extra) -> dict:
        """The environment of slurm's clients and daemons: SLURM_CONF names the state dir's
        slurm.conf."""
        return {**os.environ, "SLURM_CONF": self.path("slurm.conf"), **extra}

    def run(self, *command, cwd=None, timeout=60, **extra_env) -> subprocess.CompletedProcess:
        """A slurm client (sbatch, squeue, scontrol, sinfo) on this machine, its environment
        this process's with extra_env added (sbatch hands it to the job)."""
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=self.env(**extra_env), cwd=cwd)

    # --- start -------------------------------------------------------------------------------
    def _start(self) -> None:
        ensure_installed()
        self.state = tempfile.mkdtemp(prefix="parm_slurm_")
        os.chmod(self.state, 0o700)  # munged refuses a key or socket others could reach
        self.cluster.add_host_address()
        key = self.path("munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(128))
        os.chmod(key, 0o400)
        self._daemon("munged", ["munged", "-F", "--force", f"--key-file={key}",
                                f"--socket={self.path('munge.sock')}",
                                f"--pid-file={self.path('munged.pid')}",
                                f"--log-file={self.path('munged.log')}",
                                f"--seed-file={self.path('munged.seed')}"])
        self._wait_for(self.path("munge.sock"), "munged")
        self.port = _free_port()
        self._write_config()
        self._daemon("slurmctld", ["slurmctld", "-D", "-i"])
        for node in self.nodes:
            os.makedirs(self.path(f"slurmd-{node}"))
            self._daemon(f"slurmd {node}", ["ip", "netns", "exec", node, "slurmd", "-D", "-N",
                                            node])
        self.wait_idle()

    def _daemon(self, name, command) -> None:
        """Start a daemon in the foreground, as a child of this process (so that teardown
        ends and reaps it); its own output goes to the state dir."""
        with open(self.path(name.replace(" ", "-") + ".out"), "w") as out:
            self.daemons[name] = subprocess.Popen(command, env=self.env(), stdout=out,
                                                  stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL,
                                                  start_new_session=True)

    def _wait_for(self, path, name, timeout=20) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if self.daemons[name].poll() is not None or time.monotonic() > deadline:
                raise SlurmError(f"{name} did not start (logs in {self.state})")
            time.sleep(0.1)

    def _write_config(self) -> None:
        c, s = self.cluster, self.path
        lines = [
            "ClusterName=parm_emulated",
            f"SlurmctldHost=localhost({c.host_address()})",
            # a requeued job may start again after cred_expire + 1 s (120 s by default)
            "AuthType=auth/munge", f"AuthInfo=socket={s('munge.sock')},cred_expire=5",
            "CredType=cred/munge",
            "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={self.port}", f"SlurmdPort={SLURMD_PORT}",
            f"StateSaveLocation={s('ctld')}", f"SlurmdSpoolDir={s('slurmd-%n')}",
            f"SlurmctldPidFile={s('slurmctld.pid')}", f"SlurmdPidFile={s('slurmd-%n.pid')}",
            f"SlurmctldLogFile={s('slurmctld.log')}", f"SlurmdLogFile={s('slurmd-%n.log')}",
            # no cgroup, no accounting: processes are tracked by their parents
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "GresTypes=gpu",
            "ReturnToService=2", "SlurmdTimeout=30", "KillWait=5", "MinJobAge=600",
            "SchedulerParameters=sched_interval=2",  # a requeued job starts once eligible
            "EnforcePartLimits=ALL",  # a job that can never fit is refused by sbatch
        ]
        gres = f"Gres=gpu:{self.gpus} " if self.gpus else ""
        for i, node in enumerate(self.nodes):
            lines.append(f"NodeName={node} NodeAddr={c.address(i)} CPUs={self.cpus} {gres}"
                         "State=UNKNOWN")
        lines.append(f"PartitionName=emulated Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        with open(s("slurm.conf"), "w") as f:
            f.write("\n".join(lines) + "\n")
        devices = [s(f"gpu{i}") for i in range(self.gpus)]  # stand-ins for /dev/nvidiaN
        for device in devices:
            open(device, "w").close()
        with open(s("gres.conf"), "w") as f:
            f.write(f"Name=gpu File={s('gpu')}[0-{self.gpus - 1}]\n" if self.gpus else "")
        with open(s("cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\n")  # slurmd reads it even with task/none
        os.makedirs(s("ctld"))

    def wait_idle(self, timeout: float = 60) -> None:
        """Until sinfo shows every node idle."""
        deadline, states = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
            idle = [line for line in states.splitlines() if line.split()[1:] == ["idle"]]
            if len(idle) == len(self.nodes):
                return
            time.sleep(0.5)
        raise SlurmError(f"the nodes are not idle after {timeout:g} s (sinfo: "
                         f"{' '.join(states.split())}; logs in {self.state})")

    # --- jobs --------------------------------------------------------------------------------
    def job(self, job_id: str) -> dict:
        """scontrol's record of a job, as a dict (JobState, Restarts, ExitCode, StdOut, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, timeout: float) -> dict:
        """Until the job has ended (a final state, not requeued); its record."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if record.get("JobState") in ENDED:
                return record
            time.sleep(1)
        raise SlurmError(f"job {job_id} has not ended after {timeout:g} s: {self.job(job_id)}")

    def kill_ranks(self, node: int, pattern: str) -> list:
        """SIGKILL the processes of a node whose command line holds pattern (a node's ranks
        dying as if the node had failed, its slurmd left up); the pids killed."""
        pids = subprocess.run(["ip", "netns", "pids", self.nodes[node]], capture_output=True,
                              text=True).stdout.split()
        killed = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace")
                if pattern in command:
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(int(pid))
            except (OSError, ValueError):
                pass
        return killed

    # --- teardown ----------------------------------------------------------------------------
    def teardown(self) -> None:
        """Stop slurmctld and every slurmd (scontrol shutdown, then SIGTERM, then SIGKILL),
        then munged; remove the state directory."""
        if self.state is None:
            return
        if "slurmctld" in self.daemons:
            try:
                self.run("scontrol", "shutdown", timeout=15)
            except subprocess.TimeoutExpired:
                pass
        slurm = [p for name, p in self.daemons.items() if name != "munged"]
        for group in (slurm, [self.daemons["munged"]] if "munged" in self.daemons else []):
            _stop(group, grace=10 if group is slurm else 0)
        self.daemons.clear()
        shutil.rmtree(self.state, ignore_errors=True)
        self.state = None


def _stop(processes, grace: float) -> None:
    """Wait grace seconds for processes to end, then SIGTERM, then SIGKILL; reap them all."""
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        for p in processes:
            if p.poll() is None:
                p.send_signal(sig)
        for p in processes:
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
