"""`--cpu-top N`: the N tests whose processes used the most CPU, after the session.

Under `-n 2` a test's wall time says as much about what the other worker ran beside it as about
the test (the same test moves +-30 % from run to run); the CPU its processes used
moves less (the 4-rank layer test: 88-104 core-s in six runs, 63-83 s of wall time). A
test's CPU here is what its worker and the worker's descendants used from the test's setup to
the end of its teardown: for each process of the tree, its own user + system time and that of
the children it has reaped (/proc/PID/stat), so ranks that ended count through the launcher
that waited for them. Not counted: processes that left the tree (the slurm and munge daemons,
the jobs they start). A fixture's setup counts for the first test that uses it, as in
`--durations`.

    .venv/bin/python -m pytest -q -n 2 tests --cpu-top 20
"""

from __future__ import annotations

import os

import pytest

_TICK = os.sysconf("SC_CLK_TCK")
_START = pytest.StashKey[float]()
_SEEN: list = []  # (CPU seconds, node id) of each test, where the reports arrive


def tree_cpu_s(root: int) -> float:
    """CPU seconds of process `root` and its descendants (with the children each has reaped)."""
    children, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
        cpu[int(entry)] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0)
        todo += children.get(pid, [])
    return total / _TICK


def pytest_addoption(parser):
    parser.addoption("--cpu-top", type=int, default=0, metavar="N",
                     help="after the session, the N tests whose processes used the most CPU")


def _on(config) -> bool:
    return config.getoption("cpu_top") > 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    if _on(item.config):
        item.stash[_START] = tree_cpu_s(os.getpid())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield
    if _on(item.config) and _START in item.stash:  # before the teardown report is made
        item.user_properties.append(("cpu_s", tree_cpu_s(os.getpid()) - item.stash[_START]))


def pytest_runtest_logreport(report):
    """On the controller (or the only process): each test's figure, from its teardown report."""
    cpu = dict(report.user_properties).get("cpu_s") if report.when == "teardown" else None
    if cpu is not None:
        _SEEN.append((cpu, report.nodeid))


def pytest_terminal_summary(terminalreporter, config):
    if not _on(config) or not _SEEN:
        return
    write = terminalreporter.write_line
    terminalreporter.section(f"CPU of each test's processes, top {config.getoption('cpu_top')}")
    for cpu, nodeid in sorted(_SEEN, reverse=True)[:config.getoption("cpu_top")]:
        write(f"{cpu:8.1f} s  {nodeid}")
    write(f"{sum(cpu for cpu, _ in _SEEN):8.1f} s  in all ({len(_SEEN)} tests)")
