"""Resume is exact: 20 iterations straight equal 10 + save + resume + 10, on 4 ranks.

Dropout is on, so the RNG streams must be restored too; the distributed optimizer's state
goes through dist_checkpointing's resharding format; the data sampler restarts from the saved
sample count.
"""

import os

from conftest import launch, tiny_gpt_args


def test_resume_is_exact(gpt_data, tmp_path):
    layout = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
              "expert-tensor-parallel-size": 2, "sequence-parallel": True,
              "use-distributed-optimizer": True, "hidden-dropout": 0.1,
              "attention-dropout": 0.1, "lr-warmup-iters": 3, "lr-decay-iters": 20}
    straight = launch(4, tiny_gpt_args(gpt_data, **layout, **{"train-iters": 20}), tmp_path)
    assert straight.returncode == 0, straight.output[-4000:]

    ckpt = tmp_path / "ckpt"
    first = launch(4, tiny_gpt_args(gpt_data, **layout, **{"train-iters": 10,
                                                           "save": ckpt}), tmp_path)
    assert first.returncode == 0, first.output[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert not [p for p in os.listdir(ckpt) if p.endswith(".tmp")]

    resumed = launch(4, tiny_gpt_args(gpt_data, **layout, **{"train-iters": 20, "load": ckpt}),
                     tmp_path)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "resumed from" in resumed.output

    assert [r["iteration"] for r in resumed.losses] == list(range(11, 21))
    both = first.loss() + resumed.loss()
    assert len(both) == 20
    for step, (a, b) in enumerate(zip(straight.loss(), both), start=1):
        assert abs(a - b) <= 1e-6, f"iteration {step}: straight {a} vs resumed {b}"
