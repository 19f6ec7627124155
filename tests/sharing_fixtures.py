"""How the tests share the machine under pytest -n (make test); without -n each runs as it is.

    @pytest.mark.alone               times something against the machine's own speed: no other
                                     test runs meanwhile
    one_at_a_time(NAME)              compares machine state before and after: never two of
                                     one NAME at once (test files in SHARED_MACHINE_STATE)

Locks on files in the workers' common pytest-N folder, taken by an autouse fixture for the
test's own body (the fixtures of wider scope it uses are made before): every test holds the
room shared, an `alone` test exclusively; the turnstile keeps a waiting `alone` test from being
passed by the others forever. (A third worker, with the tests that time a failure run beside at
most one other, was slower here: 1308 s against 1198 s on 2026-12-07.)
"""

import contextlib
import fcntl
import os
from pathlib import Path

import pytest

# test files that compare the machine's network namespaces and links, or its slurm daemons,
# before and after: never two tests of one file at once (pytest -n). (xdist's own xdist_group
# does not group under this pytest: its node-id suffix is lost.)
SHARED_MACHINE_STATE = {"test_emulated_cluster.py": "netns", "test_slurm.py": "slurm"}


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: times something against the machine's own "
                                       "speed; under pytest -n no other test runs meanwhile")
    config.addinivalue_line("markers", "one_at_a_time(name): compares machine state before and "
                                       "after; under pytest -n never two of one name at once")


def pytest_itemcollected(item):
    if (name := SHARED_MACHINE_STATE.get(Path(item.fspath).name)) is not None:
        item.add_marker(pytest.mark.one_at_a_time(name))


@pytest.fixture(autouse=True)
def _sharing_the_machine(request, tmp_path_factory):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the workers' common pytest-N folder
    marked = request.node.get_closest_marker
    with contextlib.ExitStack() as held:

        def lock(name: str, how: int):
            f = held.enter_context(open(shared / f"{name}.lock", "a"))
            fcntl.flock(f, how)
            return f

        if (one := marked("one_at_a_time")) is not None:
            lock(one.args[0], fcntl.LOCK_EX)
        turnstile = lock("turnstile", fcntl.LOCK_EX)
        lock("room", fcntl.LOCK_EX if marked("alone") is not None else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
