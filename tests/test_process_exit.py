"""parm_trainer.process_exit.end: the exit a normal one would be, less the interpreter's
teardown; in a process multiprocessing forked, the fork's own path."""

import subprocess
import sys

from conftest import ROOT

SCRIPT = r"""
import atexit, multiprocessing, sys, threading, time
from parm_trainer.process_exit import end

def late():
    time.sleep(0.3)
    print("thread done", flush=True)

def child():
    end(0)  # returns in a forked child: the parent's atexit callback must not run here
    print("child returned", flush=True)

atexit.register(lambda: print("atexit ran", flush=True))
if sys.argv[1] == "fork":
    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join()
    print(f"child status {process.exitcode}", flush=True)
threading.Thread(target=late).start()
sys.stdout.write("unflushed")
end(int(sys.argv[2]))
print("not reached")
"""


def _run(*argv):
    return subprocess.run([sys.executable, "-c", SCRIPT, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_end_joins_threads_runs_atexit_flushes_and_keeps_the_status():
    run = _run("plain", "3")
    assert run.returncode == 3, run.stderr
    assert run.stdout == "unflushedthread done\natexit ran\n", run.stdout


def test_end_in_a_forked_child_leaves_the_parents_atexit_alone():
    run = _run("fork", "0")
    assert run.returncode == 0, run.stderr
    assert run.stdout == ("child returned\nchild status 0\nunflushedthread done\natexit ran\n"
                          ), run.stdout
