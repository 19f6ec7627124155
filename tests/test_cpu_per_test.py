"""tests/cpu_per_test.py: a test's CPU counts its processes' descendants, ended ones too."""

import os
import subprocess
import sys
import time

from cpu_per_test import tree_cpu_s

BURN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"


def test_tree_cpu_counts_a_grandchild_alive_and_after_it_ended():
    """A child shell whose own child (a Python) burns 0.6 s of CPU: counted while the shell
    still runs (the Python alive, or ended and reaped by the shell: nothing of it is in this
    process's own counters yet), and still once this process has reaped the shell."""
    me = os.getpid()
    before = tree_cpu_s(me)
    shell = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$0"; read _', BURN],
                             stdin=subprocess.PIPE)
    try:
        deadline, grew = time.monotonic() + 10, 0.0
        while time.monotonic() < deadline and grew < 0.5:
            time.sleep(0.1)
            grew = tree_cpu_s(me) - before
        assert grew >= 0.5, grew
    finally:
        shell.communicate(b"\n", timeout=30)
    assert tree_cpu_s(me) - before >= 0.55
