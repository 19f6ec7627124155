"""How the tests share the machine under pytest -n (make test); without -n each runs as it is.

    @pytest.mark.alone               times something against the machine's own speed: no other
                                     test runs meanwhile
    @pytest.mark.light               times a failure against a bound: at most one other test
                                     runs meanwhile, the load of two workers, whatever -n is
    one_at_a_time(NAME)              compares machine state before and after: never two of
                                     one NAME at once (test files in SHARED_MACHINE_STATE)

Locks on files in the workers' common pytest-N folder, taken by an autouse fixture for the
test's own body (the fixtures of wider scope it uses are made before):

- every test holds its worker's seat (seat-gwN, shared) and the room (shared; `alone`:
  exclusive). The turnstile keeps a waiting `alone` test from being passed by the others
  forever.
- a light test, one at a time (light.lock), closes the gate (no test starts meanwhile), waits
  until the tests on all workers but one other have ended and holds their seats exclusively,
  then opens the gate: those workers wait for their seats until it ends.
"""

import contextlib
import fcntl
import os
import time
from pathlib import Path

import pytest

# test files that compare the machine's network namespaces and links, or its slurm daemons,
# before and after: never two tests of one file at once (pytest -n). (xdist's own xdist_group
# does not group under this pytest: its node-id suffix is lost.)
SHARED_MACHINE_STATE = {"test_emulated_cluster.py": "netns", "test_slurm.py": "slurm"}


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: times something against the machine's own "
                                       "speed; under pytest -n no other test runs meanwhile")
    config.addinivalue_line("markers", "light: times a failure against a bound; under pytest "
                                       "-n at most one other test runs meanwhile")
    config.addinivalue_line("markers", "one_at_a_time(name): compares machine state before and "
                                       "after; under pytest -n never two of one name at once")


def pytest_itemcollected(item):
    if (name := SHARED_MACHINE_STATE.get(Path(item.fspath).name)) is not None:
        item.add_marker(pytest.mark.one_at_a_time(name))


def _seats_of_others(shared: Path, me: str, workers: int, count: int, held) -> None:
    """Hold `count` seats of other workers exclusively, each taken as its test ends."""
    others = [f"gw{n}" for n in range(workers) if f"gw{n}" != me]
    taken = set()
    while len(taken) < count:
        for name in others:
            if name in taken:
                continue
            seat = open(shared / f"seat-{name}.lock", "a")
            try:
                fcntl.flock(seat, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                seat.close()
                continue
            held.enter_context(seat)
            taken.add(name)
            if len(taken) == count:
                return
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def _sharing_the_machine(request, tmp_path_factory):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the workers' common pytest-N folder
    me = os.environ["PYTEST_XDIST_WORKER"]
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    marked = request.node.get_closest_marker
    light = marked("light") is not None and workers > 2
    with contextlib.ExitStack() as held:

        def lock(name: str, how: int):
            f = held.enter_context(open(shared / f"{name}.lock", "a"))
            fcntl.flock(f, how)
            return f

        if (one := marked("one_at_a_time")) is not None:
            lock(one.args[0], fcntl.LOCK_EX)
        if light:
            lock("light", fcntl.LOCK_EX)
        gate = lock("gate", fcntl.LOCK_EX if light else fcntl.LOCK_SH)
        if light:
            _seats_of_others(shared, me, workers, workers - 2, held)
        lock(f"seat-{me}", fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        turnstile = lock("turnstile", fcntl.LOCK_EX)
        lock("room", fcntl.LOCK_EX if marked("alone") is not None else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
