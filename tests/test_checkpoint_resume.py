"""Resume is exact: a 12-iteration run on 4 ranks (saves in the background, --async-save) whose
rank 2 is killed at iteration 7, while the save of 6 is being written, restarts (MAX_RESTARTS),
resumes from its save at 3 and gives the straight (synchronously saving) run's losses.

Dropout is on, so the RNG streams must be restored too; the distributed optimizer's state
goes through dist_checkpointing's resharding format; the data sampler restarts from the saved
sample count. A checkpoint loads under any other layout with the same losses (dropout off),
and one of another model is refused naming the tensor.
"""

import json
import os
import random
import re
import signal

import pytest

import parm_trainer
from conftest import (assert_clean_failure, launch, launch_sh, launch_sh_until, max_relative,
                      tiny_gpt_args)
from parm_trainer.training.checkpoint.files import TRACKER
from parm_trainer.training.checkpoint import read_description


LAYOUT = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
          "expert-tensor-parallel-size": 2, "sequence-parallel": True,
          "use-distributed-optimizer": True, "hidden-dropout": 0.1,
          "attention-dropout": 0.1, "lr-warmup-iters": 3, "lr-decay-iters": 12,
          "train-iters": 12}


@pytest.fixture(scope="module")
def straight(gpt_data, tmp_path_factory):
    """12 iterations on 4 ranks with dropout, uninterrupted, saving every 3: (run, its saves)."""
    root = tmp_path_factory.mktemp("straight")
    ckpt = root / "ckpt"
    run = launch(4, tiny_gpt_args(gpt_data, **LAYOUT, save=ckpt, **{"save-interval": 3}), root)
    assert run.returncode == 0, run.output[-4000:]
    return run, ckpt


def test_resume_is_exact_after_a_killed_rank(gpt_data, tmp_path, straight):
    """Rank 2 is killed (PARM_FAULT) at iteration 7 of a 12-iteration run that saves every 3
    with --async-save: the save of 6 is still out (a save is finalised at the earliest after
    the next iteration), so the latest checkpoint is 3, itself written in the background. Under
    scripts/launch.sh with MAX_RESTARTS=2 every rank restarts, names the unfinished
    iter_0000006.tmp, resumes from iteration 3 (RNG streams included: dropout is on) and
    iterations 1-12 give the uninterrupted, synchronously saving run's losses; the saves the
    restarted job makes are finalised after later iterations, the last one at the end."""
    layout = {**LAYOUT, "save-interval": 3}
    straight, straight_ckpt = straight
    ckpt, losses = tmp_path / "ckpt", tmp_path / "l.json"
    assert (straight_ckpt / "latest_checkpointed_iteration.txt").read_text() == "12"
    assert sorted(os.listdir(straight_ckpt)) == [f"iter_{i:07d}" for i in (3, 6, 9, 12)] + [
        "latest_checkpointed_iteration.txt"]  # no .tmp left

    run = launch_sh(4, tiny_gpt_args(gpt_data, **layout, save=ckpt, load=ckpt,
                                     **{"log-losses-json": losses, "async-save": True}),
                    env={"MAX_RESTARTS": "2", "PARM_FAULT": "kill:rank=2:iter=7"}, timeout=300)
    output = run.output
    assert run.returncode == 0, output[-4000:]
    assert "PARM_FAULT: rank 2: kill at iteration 7" in output
    assert f"saving checkpoint {ckpt / 'iter_0000006'} in the background" in output
    assert f"ignored {ckpt / 'iter_0000006.tmp'}: left by a save that did not finish" in output
    assert f"resumed from {ckpt} at iteration 3" in output
    assert "RNG streams not restored" not in output
    finalised = re.findall(r"saved checkpoint \S+iter_00000(\d\d) in \d+\.\d\d s \(in the "
                           r"background, finalised at iteration (\d+)", output)
    assert [int(saved) for saved, _ in finalised] == [3, 6, 9, 12], finalised
    assert all(int(at) > int(saved) for saved, at in finalised[:-1]), finalised
    assert sorted(os.listdir(ckpt)) == sorted(os.listdir(straight_ckpt))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "12"
    rows = json.loads(losses.read_text())
    assert [r["iteration"] for r in rows] == list(range(1, 13))
    for step, (a, b) in enumerate(zip(straight.loss(), [r["lm loss"] for r in rows]), start=1):
        assert abs(a - b) <= 1e-6 * abs(a), f"iteration {step}: straight {a} vs restarted {b}"


def test_exit_signal_and_duration_save_and_resume_exactly(gpt_data, tmp_path, straight):
    """--exit-signal-handler: SIGTERM from outside to every rank and to torchrun at a random
    iteration (sent twice: the second lands in the save), as slurm signals a job step. Every
    rank stops at the same iteration boundary, a whole checkpoint is saved there, the job exits
    0. Resumed with --exit-duration-in-mins so short that it stops after its first iteration,
    saved again, exit 0; resumed to the end, iterations 1-12 give the uninterrupted run's
    losses (dropout on)."""
    straight, _ = straight
    ckpt, losses = tmp_path / "ckpt", [tmp_path / "l0.json"]
    common = {**LAYOUT, "save": ckpt, "load": ckpt}
    at = random.Random().randint(3, 6)

    def terminate(_, launcher, ranks):
        assert len(ranks) == 4, ranks
        for process in (launcher, *ranks, *ranks):  # the second time to the ranks: in the save
            process.send_signal(signal.SIGTERM)

    status, output = launch_sh_until(4,
        tiny_gpt_args(gpt_data, **common, **{"exit-signal-handler": True,
                                             "log-losses-json": losses[0]}),
        rf"^ *iteration +{at}/12 ", terminate)
    assert status == 0, output[-4000:]
    stopped = int(re.search(r"exiting after iteration (\d+): SIGTERM received "
                            r"\(--exit-signal-handler\), saving a checkpoint here", output)[1])
    assert at <= stopped < 11, (at, stopped)
    assert (ckpt / TRACKER).read_text() == str(stopped)
    assert sorted(os.listdir(ckpt)) == [f"iter_{stopped:07d}", TRACKER], "no .tmp left"

    # the resumed runs need no signal from outside: launched as the other tests launch
    run = launch(4, tiny_gpt_args(gpt_data, **common, **{"exit-duration-in-mins": 1e-4}),
                 tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    assert f"resumed from {ckpt} at iteration {stopped}" in run.output
    assert (f"exiting after iteration {stopped + 1}: past --exit-duration-in-mins 0.0001"
            in run.output), run.output[-3000:]
    assert (ckpt / TRACKER).read_text() == str(stopped + 1)

    last = launch(4, tiny_gpt_args(gpt_data, **common), tmp_path)
    assert last.returncode == 0, last.output[-4000:]
    rows = json.loads(losses[0].read_text()) + run.losses + last.losses
    assert [r["iteration"] for r in rows] == list(range(1, 13))
    for step, (a, b) in enumerate(zip(straight.loss(), [r["lm loss"] for r in rows]), start=1):
        assert abs(a - b) <= 1e-6 * abs(a), f"iteration {step}: straight {a} vs stopped {b}"


# --- resume under another layout -----------------------------------------------------------

SAVED_LAYOUT = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
                "expert-tensor-parallel-size": 2, "sequence-parallel": True,
                "use-distributed-optimizer": True}
SCHEDULE = {"lr-warmup-iters": 3, "lr-decay-iters": 20, "train-iters": 15}
OTHER_LAYOUTS = {
    "tp1_ep4": (4, {"expert-model-parallel-size": 4, "use-distributed-optimizer": True}),
    "tp2_ep2_esp1": (4, {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
                         "expert-tensor-parallel-size": 1, "use-distributed-optimizer": True}),
    "pp2_ep2": (4, {"pipeline-model-parallel-size": 2, "expert-model-parallel-size": 2,
                    "use-distributed-optimizer": True}),
    "one_rank": (1, {"use-distributed-optimizer": True}),
}


@pytest.fixture(scope="module")
def saved_at_10(gpt_data, tmp_path_factory):
    """15 iterations under TP2 x EP2 x ESP2 + SP with the distributed optimizer, saved at 10;
    the tracker then points at 10, as if the run had stopped there."""
    tmp = tmp_path_factory.mktemp("saved_at_10")
    ckpt = tmp / "ckpt"
    run = launch(4, tiny_gpt_args(gpt_data, **SAVED_LAYOUT, **SCHEDULE,
                                  **{"save": ckpt, "save-interval": 10}), tmp)
    assert run.returncode == 0, run.output[-4000:]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    return ckpt, run


def test_checkpoint_describes_the_run(saved_at_10, gpt_data):
    ckpt, run = saved_at_10
    assert re.search(r"saved checkpoint \S+iter_0000010 in \d+\.\d\d s", run.output), run.output
    description = json.loads((ckpt / "iter_0000010" / "run.json").read_text())
    assert description["version"] == parm_trainer.__version__
    assert description["iteration"] == 10
    assert description["layout"] == {"tp": 2, "pp": 1, "dp": 2, "ep": 2, "esp": 2, "world": 4}
    assert description["args"]["hidden_size"] == 64 and description["args"]["num_experts"] == 4
    copied = (ckpt / "iter_0000010" / "tokenizer.model").read_bytes()
    assert copied == open(gpt_data["tokenizer"], "rb").read()
    assert read_description(str(ckpt))["iteration"] == 10  # the parent finds the latest


@pytest.mark.parametrize("name", OTHER_LAYOUTS)
def test_resume_under_another_layout(name, saved_at_10, gpt_data, tmp_path):
    """Model, Adam's moments and step, LR schedule and data position all carry over: the losses
    of iterations 11-15 are those of the run that went on in the saved layout."""
    ckpt, straight = saved_at_10
    nproc, layout = OTHER_LAYOUTS[name]
    run = launch(nproc, tiny_gpt_args(gpt_data, **layout, **SCHEDULE, load=ckpt), tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    assert "resumed from" in run.output
    assert "RNG streams not restored: the checkpoint was saved under TP2 PP1 DP2 EP2 ESP2" \
        in run.output
    assert [r["iteration"] for r in run.losses] == list(range(11, 16))
    for key in ("lm loss", "load_balancing_loss"):
        assert max_relative(run.loss(key), straight.loss(key)[10:]) <= 1e-4, key


@pytest.mark.parametrize("nproc,flags,tensor,shapes", [
    (4, {"hidden-size": 128, "tensor-model-parallel-size": 2, "expert-model-parallel-size": 2},
     "embedding.word_embeddings.weight", "[2048, 64] in the checkpoint and [2048, 128]"),
    (1, {"num-experts": 8}, "decoder.layers.mlp.router.weight",
     "[2, 4, 64] in the checkpoint and [2, 8, 64]"),
])
def test_another_model_is_refused(nproc, flags, tensor, shapes, saved_at_10, gpt_data,
                                  tmp_path):
    ckpt, _ = saved_at_10
    run = launch(nproc, tiny_gpt_args(gpt_data, **{"use-distributed-optimizer": True, **flags},
                                      **SCHEDULE, load=ckpt), tmp_path)
    assert_clean_failure(run, "does not fit this model", tensor, shapes)


def test_optimizer_kind_must_match(saved_at_10, gpt_data, tmp_path):
    """Distributed-optimizer state does not load into the plain optimizer: said in one line."""
    ckpt, _ = saved_at_10
    run = launch(1, tiny_gpt_args(gpt_data, **SCHEDULE, load=ckpt), tmp_path)
    assert_clean_failure(run, "saved with --use-distributed-optimizer", "--no-load-optim")


def test_dp_reshardable_is_refused_under_another_layout(gpt_data, tmp_path):
    """megatron-core's dp_reshardable buffers only fit their own layout: refused with the way
    out (--no-load-optim)."""
    ckpt = tmp_path / "ckpt"
    layout = {"expert-model-parallel-size": 2, "use-distributed-optimizer": True,
              "train-iters": 2}
    saved = launch(2, tiny_gpt_args(gpt_data, **layout, save=ckpt,
                                    **{"no-dist-ckpt-optim-fully-reshardable": True}), tmp_path)
    assert saved.returncode == 0, saved.output[-4000:]
    other = {**layout, "tensor-model-parallel-size": 2, "expert-tensor-parallel-size": 1,
             "train-iters": 3, "load": ckpt}
    refused = launch(2, tiny_gpt_args(gpt_data, **other), tmp_path)
    assert_clean_failure(refused, "dp_reshardable format under TP1 PP1 DP2 EP2 ESP1",
                         "--no-load-optim")


def test_finetune_takes_the_weights_only(saved_at_10, gpt_data, tmp_path):
    """--finetune: the weights of any checkpoint (here into the plain optimizer, which the
    distributed optimizer's state cannot fill), iteration 0, a fresh optimizer and schedule."""
    ckpt, straight = saved_at_10
    run = launch(1, tiny_gpt_args(gpt_data, **{**SCHEDULE, "train-iters": 2}, load=ckpt,
                                  finetune=True), tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    assert "finetuning from the weights of" in run.output
    assert [r["iteration"] for r in run.losses] == [1, 2]
    # the same first batch as the saved run's iteration 1, on trained weights: a lower loss
    assert run.loss()[0] < straight.loss()[0] - 0.2, (run.loss(), straight.loss())


def test_plain_optimizer_resumes_under_another_layout(gpt_data, tmp_path):
    """The plain (not distributed) optimizer's state is per parameter too: saved by EP2 on 2
    ranks at iteration 4, resumed on 1 rank, iterations 5-6 are the run's that went on."""
    ckpt = tmp_path / "ckpt"
    flags = {"lr-warmup-iters": 2, "train-iters": 6}
    straight = launch(2, tiny_gpt_args(gpt_data, **flags, **{"expert-model-parallel-size": 2,
                                                             "save": ckpt, "save-interval": 4}),
                      tmp_path)
    assert straight.returncode == 0, straight.output[-4000:]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    resumed = launch(1, tiny_gpt_args(gpt_data, **flags, load=ckpt), tmp_path)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert [r["iteration"] for r in resumed.losses] == [5, 6]
    assert max_relative(resumed.loss(), straight.loss()[4:]) <= 1e-4


def test_one_rank_resume_with_dropout_is_exact(gpt_data, tmp_path):
    """At TP1 dropout draws from the default CPU generator, which the checkpoint restores; the
    data iterators built after the load must not draw from it (the DataLoader's base seed comes
    from a generator of its own), nor the evaluation iterator that restarts mid-run."""
    flags = {"hidden-dropout": 0.1, "attention-dropout": 0.1, "train-iters": 6,
             "save-interval": 3, "eval-interval": 2, "eval-iters": 1}
    straight = launch(1, tiny_gpt_args(gpt_data, **flags, save=tmp_path / "a"), tmp_path)
    assert straight.returncode == 0, straight.output[-3000:]
    at_3 = tmp_path / "at_3"
    at_3.mkdir()
    (at_3 / "iter_0000003").symlink_to(tmp_path / "a" / "iter_0000003")
    (at_3 / TRACKER).write_text("3")
    resumed = launch(1, tiny_gpt_args(gpt_data, **flags, load=at_3), tmp_path)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.loss() == straight.loss()[3:]
