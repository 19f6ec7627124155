"""parm_trainer/gloo_device.py: the gloo groups of a process on one shared device."""

import datetime
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from parm_trainer import gloo_device


def _loop_threads() -> int:
    """This process's gloo transport loops (one thread per device, named by gloo)."""
    names = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return names.count("gloo_tcp_loop")


def test_groups_share_one_device_and_reduce_as_before(monkeypatch):
    """Two ranks in two threads of this process, 6 groups each, built as torch.distributed
    builds a gloo group: at most one new loop thread for the 12 (torch's own: one each), every
    group a ProcessGroupGloo to torch's isinstance checks, and 6 all-reduces in turn correct."""
    monkeypatch.setattr(distributed_c10d, "ProcessGroupGloo", distributed_c10d.ProcessGroupGloo)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(gloo_device, "_DEVICES", [])  # made here, by both ranks at once
    gloo_device.share_one_device()
    store, before, out = dist.HashStore(), _loop_threads(), {}

    def rank(r):
        try:
            groups = [distributed_c10d.ProcessGroupGloo(dist.PrefixStore(f"group{i}", store), r,
                                                        2, timeout=datetime.timedelta(seconds=60))
                      for i in range(6)]
            x = torch.tensor([float(r + 1)])
            for group in groups:
                group.allreduce([x]).wait()
            out[r] = (x.item(), all(isinstance(g, distributed_c10d.ProcessGroupGloo) and
                                    isinstance(g, dist.ProcessGroupGloo) for g in groups))
            out[f"loops{r}"] = _loop_threads()
        except Exception as error:  # said in the assertion below
            out[r] = repr(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert out[0] == out[1] == (3.0 * 2 ** 5, True), out
    assert max(out["loops0"], out["loops1"]) - before <= 1, (before, out)


def test_threads_building_their_first_groups_at_once_get_one_device(monkeypatch):
    """The shared devices are made once, also where two threads ask at the same moment (each
    would otherwise make its own, and their groups would disagree on the devices)."""
    made = []

    class SlowGloo:
        @staticmethod
        def create_default_device():
            time.sleep(0.2)  # both threads inside at once, were there no lock
            made.append(object())
            return made[-1]

    monkeypatch.setattr(gloo_device, "_GLOO", SlowGloo)
    monkeypatch.setattr(gloo_device, "_DEVICES", [])
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    got = {}
    threads = [threading.Thread(target=lambda r=r: got.update({r: gloo_device._devices()}))
               for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(made) == 1 and got[0] == got[1] == made, (made, got)
