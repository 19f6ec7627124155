"""The ranks' side of tests/test_calibrate_comm.py's wait test (4 ranks as 2 nodes x 2, under
conftest.torchrun): the waits at a call in each node's group, the burst after a pause across
the nodes and on one node; rank 0 prints what the test reads."""
import statistics

import torch
import torch.distributed as dist

from parm_trainer.bench.calibration import waits

dist.init_process_group("gloo")
made = []
enumerate_groups = dist.new_subgroups_by_enumeration


def recorded(ranks, **kwargs):
    made.append(ranks)
    return enumerate_groups(ranks, **kwargs)


dist.new_subgroups_by_enumeration = recorded
points = waits.measure_sync_wait(1, 0, torch.device("cpu"), 1, per_node=2, rounds=2)
burst = waits.measure_burst(2, torch.device("cpu"), per_node=2, pause=0.01)
one_node = waits.measure_burst(2, torch.device("cpu"), per_node=4)
if dist.get_rank() == 0:
    # the points go round by round, collective by collective, stretch by stretch
    stretch = [statistics.median(c for i, (c, _) in enumerate(points) if i % 3 == k)
               for k in range(3)]
    print("groups", made, "points", len(points), "ok",
          all(stretch > 0 and wait >= 0 for stretch, wait in points),
          "stretches", stretch[0] < stretch[2])
    print("burst sizes", [b for b, _, _ in burst], "timed",
          all(s > 0 and p > 0 for _, s, p in burst), "one node", one_node)
dist.destroy_process_group()
