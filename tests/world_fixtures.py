"""One-rank worlds for in-process tests of code that talks to a process group.

    def test_x(one_rank_gloo): ...    # a one-rank gloo world (dist.group.WORLD)
    def test_y(one_rank_world): ...   # the same with megatron's model-parallel groups

Each is torn down after its module, unless a world was already there.
"""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank_gloo():
    from parm_trainer.compat import cpu

    cpu.apply()  # megatron-core's CUDA assumptions, answered on CPU
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_world(one_rank_gloo):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
