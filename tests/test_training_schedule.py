"""Megatron-LM's training schedules: sample-based training (--train-samples, --lr-decay-samples,
--lr-warmup-samples), --lr-warmup-fraction, --lr-warmup-init and the batch-size ramp-up
(--rampup-batch-size START INCREMENT SAMPLES).

Each is held against megatron-core's own OptimizerParamScheduler and micro-batch calculator,
configured here from the numbers as Megatron-LM's training.py configures them
(get_optimizer_param_scheduler, update_train_iters, train_step's increment); then one 2-rank MoE
GPT run trains on a ramp-up, stops where Megatron-LM would, and resumes mid-ramp-up with the
same learning rates, batch sizes and losses.
"""

import json
import re
import shutil

import pytest
from megatron.core import dist_checkpointing
from megatron.core.num_microbatches_calculator import (
    RampupBatchsizeNumMicroBatchesCalculator, destroy_num_microbatches_calculator,
    get_current_global_batch_size, get_num_microbatches, update_num_microbatches)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from conftest import launch, tiny_gpt_args
from parm_trainer.arguments import parse_args
from parm_trainer.planning import batch_schedule
from parm_trainer.planning.checks import validate_layout
from parm_trainer.training.checkpoint.files import TRACKER
from parm_trainer.training.checkpoint.state import scheduler_in_samples
from parm_trainer.training.lr_schedule import build_scheduler

# 4 data-parallel ranks of 2-sample micro-batches; the batch ramps 16, 32, 48 over 600 samples
# (200 each: (64 - 16) / 16 = 3 increments) to 64.
RAMP = ["--micro-batch-size", "2", "--global-batch-size", "64", "--rampup-batch-size", "16",
        "16", "600"]
# Per iteration, by megatron-core's rule (size = 16 + 16 * int(consumed / 200) while consumed
# <= 600): iterations 1-13 take 16 (consumed 0..192 before each), 14-19 take 32 (208..368),
# 20-24 take 48 (400..592), then 64. Megatron-LM's update_train_iters for 2000 samples: the
# ramp-up's 24 iterations (640 samples), then (2000 - 640) // 64 = 21: 45 iterations, 1984
# samples.
RAMP_SIZES = [16] * 13 + [32] * 6 + [48] * 5 + [64] * 21


def _run_args(argv, world_size=4):
    args = parse_args(argv, world_size=world_size)
    validate_layout(args)
    return args


class _Optimizer:
    """What OptimizerParamScheduler drives: the optimizer's parameter groups."""

    def __init__(self):
        self.param_groups = [{}]


@pytest.fixture
def calculator():
    """megatron-core's process-wide micro-batch calculator, removed after the test."""
    yield
    destroy_num_microbatches_calculator()


def _trained(args, iterations):
    """The loop's bookkeeping (training/loop.py), without the model: per iteration the
    calculator is brought to the samples consumed, the schedule steps by the iteration's
    global batch. [(global batch size, micro-batches, learning rate after the step)]."""
    batch_schedule.start(args, rank=0)
    scheduler = build_scheduler(args, _Optimizer())
    consumed, rows = 0, []
    for _ in range(iterations):
        update_num_microbatches(consumed, consistency_check=True)
        size = get_current_global_batch_size()
        scheduler.step(increment=size)
        consumed += size
        rows.append((size, get_num_microbatches(), scheduler.get_lr({})))
    return rows


def _megatron_lm(reference: OptimizerParamScheduler, ramp, iterations, micro=2, dp=4):
    """Megatron-LM's train loop over megatron-core's pieces: update_num_microbatches(consumed)
    before each iteration, then increment = micro-batches x micro-batch size x DP (train_step)
    for the schedule and the samples consumed."""
    consumed, rows = 0, []
    for _ in range(iterations):
        ramp.update(consumed, consistency_check=True)
        increment = ramp.get() * micro * dp
        reference.step(increment=increment)
        consumed += increment
        rows.append((ramp.get_current_global_batch_size(), ramp.get(),
                     reference.get_lr({})))
    return rows


def test_ramp_up_follows_megatron_cores_calculator(calculator):
    """Each iteration's global batch size and micro-batch count are those of megatron-core's
    RampupBatchsizeNumMicroBatchesCalculator built from the numbers, fed Megatron-LM's sample
    count."""
    args = _run_args(["--train-samples", "2000", *RAMP])
    assert args.train_iters == 45 and batch_schedule.planned_samples(args) == 1984
    assert (args.global_batch_size, args.num_microbatches) == (64, 8)  # the full sizes stay
    ours = _trained(args, args.train_iters)
    theirs = _megatron_lm(OptimizerParamScheduler(
        _Optimizer(), 0.0, 1e-3, 0.0, 0, 2000, "constant", 0.0, 0.0, 2000, "constant"),
        RampupBatchsizeNumMicroBatchesCalculator(64, 2, 4, False, 0, 16, 16, 600),
        args.train_iters)
    assert [row[:2] for row in ours] == [row[:2] for row in theirs]
    assert [size for size, _, _ in ours] == RAMP_SIZES
    for iteration, size, micro in ((1, 16, 2), (13, 16, 2), (14, 32, 4), (20, 48, 6),
                                   (24, 48, 6), (25, 64, 8), (45, 64, 8)):
        assert ours[iteration - 1][:2] == (size, micro), iteration


CONSTANT = ["--micro-batch-size", "2", "--global-batch-size", "64"]


@pytest.mark.parametrize("batch,samples,iterations,planned", [
    (RAMP, 2000, 45, 1984),
    # consumed reaches --train-samples 64 exactly before iteration 5 (16 x 4): Megatron-LM's
    # ramp-up loop counts on while consumed <= it, so a fifth iteration takes the run to 80
    (RAMP, 64, 5, 80),
    (CONSTANT, 1000, 15, 960),  # whole global batches; the rest dropped
], ids=["ramp_up", "ramp_up_to_the_last_sample", "constant"])
def test_train_samples_give_megatron_lms_iterations(batch, samples, iterations, planned):
    """--train-samples gives update_train_iters' iterations; the training split is asked for
    the samples they take (more than --train-samples where the ramp-up passes it). A run
    without either length flag keeps 100 iterations."""
    args = _run_args(["--train-samples", str(samples), *batch])
    assert (args.train_iters, batch_schedule.planned_samples(args)) == (iterations, planned)
    default = _run_args([])
    assert (default.train_iters, default.lr_decay_iters, default.train_samples) == (100, 100, None)


def test_ramp_up_with_train_iters_trains_those_iterations(calculator):
    """Megatron-LM's own GPT-3 recipe ramps the batch up under --train-iters (its
    validate_args refuses that): here it trains --train-iters iterations of the ramped sizes,
    megatron-core's calculator's, and the training split holds what they take."""
    args = _run_args(["--train-iters", "30", *RAMP])
    assert args.train_iters == 30 and args.train_samples is None
    assert batch_schedule.planned_samples(args) == sum(RAMP_SIZES[:30])
    assert [size for size, _, _ in _trained(args, 30)] == RAMP_SIZES[:30]


SAMPLES = ["--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-init", "1e-5",
           "--lr-decay-style", "cosine", "--train-samples", "2000", *RAMP]


@pytest.mark.parametrize("flags,warmup,decay", [
    (["--lr-warmup-samples", "300", "--lr-decay-samples", "1800"], 300, 1800),
    (["--lr-warmup-fraction", "0.15"], 0.15 * 2000, 2000),  # of --train-samples, the decay
], ids=["warmup_samples", "warmup_fraction"])
def test_sample_based_learning_rate_is_megatron_lms(flags, warmup, decay, calculator):
    """The learning rate after every iteration of a sample-based schedule on a ramp-up equals
    megatron-core's OptimizerParamScheduler built as get_optimizer_param_scheduler builds it
    for --train-samples (lengths in samples, the warmup from --lr-warmup-init), stepped by
    each iteration's global batch."""
    args = _run_args([*SAMPLES, *flags])
    reference = OptimizerParamScheduler(
        _Optimizer(), init_lr=1e-5, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=2000, wd_incr_style="constant")
    ramp = RampupBatchsizeNumMicroBatchesCalculator(64, 2, 4, False, 0, 16, 16, 600)
    ours, theirs = _trained(args, args.train_iters), _megatron_lm(reference, ramp, 45)
    assert [lr for _, _, lr in ours] == [lr for _, _, lr in theirs]
    # after iteration 1 (16 samples of the warmup) and at the end (1984 samples: past a decay
    # of 1800, min-lr; within one of 2000, near it)
    assert ours[0][2] == pytest.approx(1e-5 + (1e-3 - 1e-5) * 16 / warmup)
    assert ours[-1][2] == pytest.approx(1e-4, rel=1e-2)


def test_warmup_fraction_with_iterations_is_megatron_lms(calculator):
    """--lr-warmup-fraction under --train-iters: Megatron-LM counts the iterations' samples
    (lengths x --global-batch-size) and warms up over the fraction of the decay."""
    args = _run_args(["--train-iters", "50", "--lr-decay-iters", "40", "--lr-warmup-fraction",
                      "0.1", "--lr-warmup-init", "2e-4", "--lr", "1e-3", "--min-lr", "1e-5",
                      "--lr-decay-style", "linear", "--micro-batch-size", "2",
                      "--global-batch-size", "64"])
    reference = OptimizerParamScheduler(
        _Optimizer(), init_lr=2e-4, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=0.1 * 40 * 64,
        lr_decay_steps=40 * 64, lr_decay_style="linear", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=50 * 64, wd_incr_style="constant")
    ours, theirs = _trained(args, 50), []
    for _ in range(50):  # no ramp-up under --train-iters: 8 micro-batches of 2 on 4 ranks
        reference.step(increment=8 * 2 * 4)
        theirs.append(reference.get_lr({}))
    assert [lr for _, _, lr in ours] == theirs
    assert ours[1][2] == pytest.approx(2e-4 + (1e-3 - 2e-4) * 2 / 4)  # 2 of 4 warmup iters
    assert ours[-1][2] == 1e-5  # past the decay's 40 iterations


def test_checkpoints_that_counted_iterations_resume_in_samples():
    """A checkpoint saved before the schedule counted samples holds its position and lengths
    in iterations (one global batch each): scaled on load; one that says samples is kept."""
    saved = {"num_steps": 10, "lr_warmup_steps": 3, "lr_decay_steps": 20, "wd_incr_steps": 20,
             "max_lr": 1e-3, "min_lr": 0.0, "lr_decay_style": "cosine"}
    old = scheduler_in_samples(saved, {"iteration": 10, "consumed_train_samples": 80})
    assert old == {**saved, "num_steps": 80, "lr_warmup_steps": 24, "lr_decay_steps": 160,
                   "wd_incr_steps": 160}
    now = {"iteration": 10, "consumed_train_samples": 80, "scheduler_counts": "samples"}
    assert scheduler_in_samples(saved, now) == saved


# --- one run on 2 ranks: the ramp-up, its stop and a resume mid-ramp-up -------------------------

# 2 data-parallel ranks of 1-sample micro-batches (EP2: each rank holds 2 of the 4 experts); the
# batch ramps 2, 4, 6 over 12 samples (4 each) to 8. By megatron-core's rule: iterations 1-2
# take 2 (consumed 0, 2 before), 3 takes 4 (4), 4 takes 6 (8), then 8 (14, 22, 30). Megatron-
# LM's update_train_iters for 40 samples: the ramp-up runs while consumed <= 12: 4 iterations,
# 14 samples; then (40 - 14) // 8 = 3: 7 iterations, 38 samples.
RUN = {"train-iters": None, "train-samples": 40, "micro-batch-size": 1, "global-batch-size": 8,
       "expert-model-parallel-size": 2, "moe-parm-schedule": "s1", "moe-parm-chunks": 1,
       "overlap-moe-expert-parallel-comm": True, "lr": 1e-3, "min-lr": 1e-4,
       "lr-warmup-samples": 6, "lr-warmup-init": 1e-4, "eval-iters": 0, "save-interval": 3}
RUN_RAMP = ["--rampup-batch-size", "2", "2", "12"]
RUN_SIZES = [2, 2, 4, 6, 8, 8, 8]


def _megatron_lm_run_lrs() -> list:
    reference = OptimizerParamScheduler(
        _Optimizer(), init_lr=1e-4, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=6,
        lr_decay_steps=40, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=40, wd_incr_style="constant")
    ramp = RampupBatchsizeNumMicroBatchesCalculator(8, 1, 2, False, 0, 2, 2, 12)
    return [lr for _, _, lr in _megatron_lm(reference, ramp, 7, micro=1, dp=2)]


def test_ramp_up_run_stops_and_resumes_mid_ramp_up(gpt_data, tmp_path):
    """A 2-rank MoE GPT run with --train-samples 40 and --rampup-batch-size 2 2 12 (its
    micro-batches overlapped in pairs once there are two): every iteration's global batch
    size and learning rate are Megatron-LM's, the log line says the batch size, the run stops
    after update_train_iters' 7 iterations. Resumed from its save at iteration 3 (8 samples
    consumed, the next batch 6), iterations 4-7 repeat the same batch sizes, learning rates and
    losses."""
    ckpt = tmp_path / "ckpt"
    straight = launch(2, tiny_gpt_args(gpt_data, **RUN, save=ckpt) + RUN_RAMP, tmp_path)
    assert straight.returncode == 0, straight.output[-4000:]
    rows = straight.losses
    assert [row["iteration"] for row in rows] == list(range(1, 8)), straight.output[-3000:]
    assert json.loads((ckpt / TRACKER).read_text()) == 7  # saved at its end, iteration 7
    assert [row["global batch size"] for row in rows] == RUN_SIZES
    assert [row["lr"] for row in rows] == _megatron_lm_run_lrs()
    for row in rows:  # each iteration trained on its own batch size, its router losses the
        # mean over that many micro-batches (near 1 for an even routing; a divisor of the full
        # 4 micro-batches per rank would give 1/4 at the first iterations)
        routed = [sum(layer) for layer in row["tokens per expert"]]
        assert routed == [row["global batch size"] * 64 * 2] * 2, row  # x seq 64 x top-2
        assert 0.9 < row["load_balancing_loss"] < 1.2, row
    common = dist_checkpointing.load_common_state_dict(str(ckpt / "iter_0000003"))
    assert common["consumed_train_samples"] == 8  # 2 + 2 + 4
    assert common["opt_param_scheduler"]["num_steps"] == 8  # the schedule counts samples
    assert re.search(r"iteration +4/7 \| lm loss \S+ \| lr \S+ \| global batch size 6 \|",
                     straight.output), straight.output[-3000:]

    resumed_dir = tmp_path / "from_3"  # the save of iteration 3 as the latest one
    shutil.copytree(ckpt / "iter_0000003", resumed_dir / "iter_0000003")
    (resumed_dir / TRACKER).write_text("3")
    resumed = launch(2, tiny_gpt_args(gpt_data, **{**RUN, "save-interval": None},
                                      load=resumed_dir) + RUN_RAMP, tmp_path)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"resumed from {resumed_dir} at iteration 3" in resumed.output
    again = resumed.losses
    assert [row["iteration"] for row in again] == list(range(4, 8)), resumed.output[-3000:]
    for key in ("global batch size", "lr"):
        assert [row[key] for row in again] == [row[key] for row in rows[3:]], key
    for before, after in zip(rows[3:], again):
        assert abs(before["lm loss"] - after["lm loss"]) <= 1e-6 * abs(before["lm loss"]), \
            (before, after)
