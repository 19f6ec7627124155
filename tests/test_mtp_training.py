"""Training with multi-token prediction (--mtp-num-layers 2) on 4 ranks, PP2 x EP2: Parm's
default schedule (auto) against megatron-core's own dispatcher (the same losses, the MTP
losses of the log line included), then a resume of the checkpoint under TP2 x EP2 (no pipeline:
the MTP layers move from the second stage's ranks to every rank, and are split over TP)."""

import pytest

from conftest import launch, max_relative, tiny_gpt_args

from parm_trainer.training.checkpoint.files import TRACKER

MTP = {"mtp-num-layers": 2, "position-embedding-type": "rope", "normalization": "RMSNorm",
       "swiglu": True, "moe-layer-freq": "[0,1]", "expert-model-parallel-size": 2,
       "untie-embeddings-and-output-weights": True, "save-interval": 3}
PP2 = {"pipeline-model-parallel-size": 2}
NAMES = ("lm loss", "mtp_1 loss", "mtp_2 loss")


@pytest.fixture(scope="module")
def mtp_runs(gpt_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return root, {schedule: launch(4, tiny_gpt_args(gpt_data, **MTP, **PP2,
                                                    **{"moe-parm-schedule": schedule},
                                                    save=root / schedule), root)
                  for schedule in ("auto", "megatron")}


def test_mtp_trains_alike_under_parm_and_megatron(mtp_runs):
    _, runs = mtp_runs
    for run in runs.values():
        assert run.returncode == 0, run.output[-4000:]
        assert "PP rank 1: layer 2 (MoE), 2 MTP layers, loss" in run.output, run.output[-4000:]
        lines = [line for line in run.output.splitlines() if line.startswith("iteration")]
        assert len(lines) == 5 and all(" | mtp_1 loss " in line and " | mtp_2 loss " in line
                                       for line in lines), lines
    parm, megatron = runs["auto"], runs["megatron"]
    for name in NAMES:
        assert len(parm.loss(name)) == 5 and parm.loss(name)[-1] < parm.loss(name)[0], name
        assert max_relative(parm.loss(name), megatron.loss(name)) < 1e-5, name
    # the MTP layers predict further ahead: a harder task than the next token at the start
    assert parm.loss("mtp_2 loss")[0] > 0.5 * parm.loss("lm loss")[0]


def test_mtp_checkpoint_resumes_under_another_layout(mtp_runs, gpt_data):
    root, runs = mtp_runs
    at_3 = root / "auto_at_3"
    at_3.mkdir()
    (at_3 / "iter_0000003").symlink_to(root / "auto" / "iter_0000003")
    (at_3 / TRACKER).write_text("3")
    # the plain optimizer's checkpoint has no step of the expert optimizer: rank 0 (the first
    # stage, without MoE layers) wrote the common state (optimizer_state.with_common_steps)
    flags = {**MTP, "tensor-model-parallel-size": 2, "moe-parm-schedule": "s1", "load": at_3}
    run = launch(4, tiny_gpt_args(gpt_data, **flags), root)
    assert f"resumed from {at_3} at iteration 3" in run.output, run.output[-4000:]
    for name in NAMES:
        assert len(run.loss(name)) == 2, name
        assert max_relative(run.loss(name), runs["auto"].loss(name)[3:5]) < 1e-5, name
