"""gloo process groups that share one transport device per process (the gloo backend only).

torch gives every gloo process group a device of its own, and every device runs a thread that
wakes each 10 ms (gloo's tcp loop waits on epoll with a 10 ms timeout) whether or not its group
is in use. megatron-core builds about 50 groups per rank (4 ranks, TP 2 x EP 2): 51 such threads
per rank, 0.08 s of CPU per second per rank while the job does nothing, a sixth of a 2-core
machine for a job of 4 ranks. Here every group of the process is built on one device, as torch
builds a group (the devices of GLOO_SOCKET_IFNAME's interfaces, else the host's, two worker
threads per device): one polling thread per rank. Each group keeps its own context, pairs and
worker threads; the one thread only serves their sockets' readiness.
"""

from __future__ import annotations

import datetime
import os
import threading

import torch.distributed as dist
from torch.distributed import distributed_c10d

_GLOO = dist.ProcessGroupGloo
_DEVICES: list = []
_MADE = threading.Lock()


def _devices() -> list:
    """The process's devices, made on first use as torch's own constructor makes a group's
    (once, also where two threads build their first groups at the same time)."""
    with _MADE:
        if not _DEVICES:
            interfaces = os.environ.get("GLOO_SOCKET_IFNAME", "")
            _DEVICES.extend([_GLOO.create_device(interface=name)
                             for name in interfaces.split(",")]
                            if len(interfaces) > 1 else [_GLOO.create_default_device()])
        return list(_DEVICES)


class _OnSharedDevices(type):
    """distributed_c10d's ProcessGroupGloo: a call builds torch's ProcessGroupGloo on the
    shared devices; isinstance and attributes are the real class's."""

    def __call__(cls, store, rank, size, timeout=datetime.timedelta(minutes=30)):
        if isinstance(timeout, _GLOO._Options):  # the constructor's other form: as given
            return _GLOO(store, rank, size, timeout)
        options = _GLOO._Options()
        options._devices = _devices()
        options._timeout = timeout
        options._threads = 2 * len(options._devices)
        return _GLOO(store, rank, size, options)

    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, _GLOO)

    def __getattr__(cls, name):
        return getattr(_GLOO, name)


class SharedDeviceGloo(metaclass=_OnSharedDevices):
    """Stands for ProcessGroupGloo where torch.distributed builds gloo groups."""


def share_one_device() -> None:
    """Every gloo group this process builds from now on uses the shared devices."""
    distributed_c10d.ProcessGroupGloo = SharedDeviceGloo
