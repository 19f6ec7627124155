"""A per-rank watchdog: a hung job ends within --watchdog-timeout-minutes, naming who stopped.

gloo cannot abort a collective that waits on a dead or stopped peer, and a stopped process
answers no signal but SIGKILL, so a timeout alone can leave a job half-alive. Each rank runs a
thread that, every second, publishes two times to the job's rendezvous store (a key per rank):
when its thread last ran (the process is alive) and when its training loop last stepped (an
iteration's phase, a save's phase; `beat` is one tuple assignment). When a rank's loop has not
stepped for the limit, its thread reads every rank's keys and ends the job:

- a rank whose thread stopped publishing (killed, SIGSTOP, its host gone) is the cause; one
  line names it, its iteration and phase, and the phase the waiting ranks were in;
- otherwise every process is alive and one line names the rank furthest behind (a deadlock or a
  straggler, for example a save that never ends);
- the first rank to fire prints the line (the store elects it); every rank that sees the abort
  kills the stopped ranks on its own host (SIGKILL works on a stopped process) and exits 1;
- a rank that cannot reach the store (its node's link is down, or the store's node) says so in
  its own line and exits 1 when its own limit passes: the limit is checked by a second thread
  that never touches the store, so a store call that hangs cannot keep the rank alive.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time

from parm_trainer import error_line

PERIOD_S = 1.0
BEFORE_TIMEOUT = 0.8  # the watchdog fires by this share of --distributed-timeout-minutes
ALIVE_S = 5.0  # a rank whose thread has not published for this long is not running


class Watchdog:
    def __init__(self, limit_s: float, store, rank: int, world: int):
        self.limit_s, self.rank, self.world = limit_s, rank, world
        self.store = store
        self.host, self.pid = _host(), os.getpid()
        self.last = (time.time(), 0, "set-up")  # (when, iteration, phase) of the loop's step
        self.stopped = threading.Event()
        self.reached_store = time.time()  # the last store call that returned
        self.threads = [threading.Thread(target=self._run, name="parm-watchdog", daemon=True),
                        threading.Thread(target=self._check_alone, name="parm-watchdog-limit",
                                         daemon=True)]

    def start(self) -> "Watchdog":
        self._publish(time.time())
        for thread in self.threads:
            thread.start()
        return self

    def beat(self, iteration: int, phase: str) -> None:
        self.last = (time.time(), iteration, phase)

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout=2 * PERIOD_S)

    def _publish(self, now: float) -> None:
        when, iteration, phase = self.last
        self.store.set(f"hb/{self.rank}", json.dumps(
            [now, when, iteration, phase, self.pid, self.host]))
        self.reached_store = time.time()

    def _beats(self) -> dict:
        out = {}
        for rank in range(self.world):
            try:
                if self.store.check([f"hb/{rank}"]):
                    out[rank] = json.loads(self.store.get(f"hb/{rank}"))
            except Exception:  # a store going away: the rank is unknown
                pass
        return out

    def _run(self) -> None:
        while not self.stopped.wait(PERIOD_S):
            now = time.time()
            try:
                self._publish(now)
                if self.store.check(["abort"]):
                    self._end(self._beats(), now, None)
                if now - self.last[0] > self.limit_s:
                    self._fire(now)
            except Exception:  # the store is gone: the job is ending anyway
                return

    def _check_alone(self) -> None:
        """The limit without the store: past it (with a margin for the store-side check to
        speak first) and the store silent, end this rank with its own line."""
        while not self.stopped.wait(PERIOD_S):
            now = time.time()
            when, iteration, phase = self.last
            if now - when > self.limit_s + 2 * PERIOD_S and now - self.reached_store > ALIVE_S:
                self._end({}, now, (
                    f"watchdog: rank {self.rank} made no progress for {now - when:.0f} s at "
                    f"iteration {iteration} in {phase} and cannot reach the job's store for "
                    f"{now - self.reached_store:.0f} s (its node's link, or the store's node, "
                    f"is down; --watchdog-timeout-minutes)"))

    def fire_now(self) -> None:
        """End the job now (a collective failed), as at the limit; does not return."""
        try:
            self._fire(time.time())
        except Exception:  # the store is gone too: this rank's own line
            when, iteration, phase = self.last
            self._end({}, time.time(), f"watchdog: rank {self.rank}'s collective failed at "
                                       f"iteration {iteration} in {phase} and the job's store "
                                       f"cannot be reached; the job is ended")

    def _fire(self, now: float) -> None:
        beats = self._beats()
        first = self.store.add("abort_count", 1) == 1
        line = (describe(beats, self.world, self.rank, now, self.limit_s, self.last)
                if first else None)
        self.store.set("abort", "1")
        self._end(beats, now, line)

    def _end(self, beats: dict, now: float, line) -> None:
        for rank, (alive, _, _, _, pid, host) in beats.items():
            if host == self.host and pid != self.pid and now - alive > ALIVE_S:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if line:
            error_line.say(f"error: {line}")
        sys.stdout.flush()
        stop_helpers()
        os._exit(1)


def _host() -> str:
    """This process's host as far as signals go: its name and network namespace (emulated nodes
    share the name and the process ids, not the namespace)."""
    try:
        return f"{socket.gethostname()}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return socket.gethostname()


def describe(beats: dict, world: int, me: int, now: float, limit_s: float, mine: tuple) -> str:
    """The one line: who stopped (or is furthest behind), where, and what this rank waited in."""
    _, iteration, phase = mine
    waited = (f"rank {me} waited {now - mine[0]:.0f} s at iteration {iteration} in {phase} "
              f"(limit {limit_s:.0f} s, --watchdog-timeout-minutes)")
    dead = sorted(r for r, beat in beats.items() if now - beat[0] > ALIVE_S)
    missing = sorted(set(range(world)) - set(beats))
    if dead:
        r = dead[0]
        _, _, it, ph, pid, host = beats[r]
        others = f" (and rank{'s' if len(dead) > 2 else ''} {', '.join(map(str, dead[1:]))})" \
            if len(dead) > 1 else ""
        return (f"watchdog: rank {r}{others} stopped responding: last heard from "
                f"{now - beats[r][0]:.0f} s ago (pid {pid} on {host.split('/')[0]}; its "
                f"heartbeat, at most {PERIOD_S:.0f} s old then, said iteration {it} in {ph}); "
                f"{waited}; the job is ended")
    if missing:
        return f"watchdog: rank {missing[0]} never reported; {waited}; the job is ended"
    r = min(beats, key=lambda k: (beats[k][2], beats[k][1]))
    _, when, it, ph, _, _ = beats[r]
    return (f"watchdog: every rank is alive but none progressed; rank {r} is furthest behind "
            f"at iteration {it} in {ph} (for {now - when:.0f} s); {waited}; the job is ended")


_CURRENT = None


def limit_s(args) -> float:
    """The watchdog's limit: --watchdog-timeout-minutes, at most BEFORE_TIMEOUT of the
    collectives' own timeout (--distributed-timeout-minutes), so that the watchdog, which
    names the rank that stopped, fires before a collective gives up with a bare timeout."""
    return min(args.watchdog_timeout_minutes, BEFORE_TIMEOUT * args.distributed_timeout_minutes) \
        * 60.0


def start(args):
    """Start this rank's watchdog (none with --watchdog-timeout-minutes 0)."""
    global _CURRENT
    import torch

    stop()
    if not args.watchdog_timeout_minutes:
        return
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import _get_default_store

    store = PrefixStore("parm_watchdog/", _get_default_store())
    _CURRENT = Watchdog(limit_s(args), store, torch.distributed.get_rank(),
                        torch.distributed.get_world_size()).start()


# what a collective raises when a peer is gone or silent (gloo's messages; NCCL's watchdog
# ends the process itself)
_COLLECTIVE_FAILURE = re.compile(r"Timed out waiting|Connection (closed|reset) by peer|"
                                 r"gloo/transport|Broken pipe|DistBackendError")


def is_collective_failure(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.distributed.DistBackendError) or bool(
        _COLLECTIVE_FAILURE.search(f"{type(error).__name__}: {error}"))


def end_on_collective_failure(error: BaseException) -> None:
    """A collective failed (a peer stopped, died or cut off): end the job as the watchdog does,
    with its one line naming the silent rank (never the collective's traceback); without a
    watchdog, one line quoting the failure. Does not return."""
    if _CURRENT is not None:
        _CURRENT.fire_now()
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    error_line.say(f"error: a collective failed ({first[:300]}); --watchdog-timeout-minutes 0, "
                   f"so no rank is named")
    sys.stdout.flush()
    stop_helpers()
    os._exit(1)


def stop_helpers() -> None:
    """SIGKILL every process this rank started (the checkpoint writers megatron forks per file,
    the results queue's manager, DataLoader workers) before it ends with os._exit, which skips
    their shutdown: torchrun signals a rank's process group only while the rank itself lives,
    and an orphaned writer would hold the launcher's output pipe open (the job's output never
    ends) or write on into the checkpoint directory."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


def beat(iteration: int, phase: str) -> None:
    """The training loop (or a save) made progress: it is at iteration, in phase."""
    if _CURRENT is not None:
        _CURRENT.beat(iteration, phase)


def stop() -> None:
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.stop()
        _CURRENT = None
