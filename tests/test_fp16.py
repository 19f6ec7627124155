"""--fp16 with megatron-core's loss scaling, as Megatron-LM runs it.

The references are megatron-core's own: its DynamicGradScaler, driven by the run's sequence of
overflowing steps, must give the loss scale the run logged after every step; its
OptimizerParamScheduler, stepped on the steps that were not skipped only, the logged LR; and an
fp32 run of the same model, the losses. In-process: the flags against megatron-core's
OptimizerConfig, and the one scaler of the dense and the expert optimizer.
"""

import math
import re
import types
import warnings

import pytest
import torch

from conftest import launch, max_relative, tiny_gpt_args
from parm_trainer.compat import cpu
from parm_trainer.training import loss_scale
from parm_trainer.training.checkpoint.files import TRACKER

# Parm's s1 with MP2 (sequence-parallel) x EP2 on 2 ranks: the dense part split over MP, the
# experts over EP, the exact exchange between them
MP2_EP2 = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
           "expert-tensor-parallel-size": 1, "sequence-parallel": True,
           "moe-parm-schedule": "s1", "moe-parm-chunks": 1, "train-iters": 10}
# megatron's own MoE layer on 2 pipeline stages, the distributed optimizer; the default initial
# scale (2**32) overflows fp16 gradients for the first steps, a short window raises the scale
# again soon after; hysteresis 2, the default
OVERFLOWING = {"pipeline-model-parallel-size": 2, "moe-parm-schedule": "megatron",
               "use-distributed-optimizer": True, "fp16": True, "loss-scale-window": 3,
               "train-iters": 24, "log-interval": 4, "save-interval": 15}
LR = 1e-3  # tiny_gpt_args's, no warm-up, cosine decay over --train-iters
# fp16 rounds each weight and activation to 11 significant bits (a relative 2**-11, 4.9e-4);
# a loss averages 512 tokens' cross entropies, and the runs measured 2.6e-5 apart over 10 steps
# (the gradient norms, of fp16 gradients, 1.2e-3: checked at 10 x this). 1e-3 holds those
# roundings, yet is under the loss's own fall per step over the first six (3e-3 to 1.2e-2
# relative): a step lost early, or taken with a wrong scale, would show.
FP16_VS_FP32 = 1e-3


@pytest.fixture(scope="module")
def patched():
    return cpu.apply()  # megatron-core's scalers create their tensors on 'cuda'


def test_flags_are_megatrons():
    """Megatron-LM's flags hand their values to OptimizerConfig and TransformerConfig by these
    names; the defaults are megatron-core's own (2**32, 1, 1000, 2, no static scale)."""
    from megatron.core.optimizer import OptimizerConfig

    from parm_trainer.arguments import parse_args
    from parm_trainer.models.config import transformer_config

    args = parse_args(["--fp16"])
    fields = loss_scale.optimizer_fields(args)
    defaults = OptimizerConfig()
    assert fields == {name: getattr(defaults, name) for name in fields} | {"fp16": True}
    assert args.params_dtype == torch.float16 and loss_scale.dynamic(args)
    config = transformer_config(args)
    assert config.fp16 and config.params_dtype == torch.float16 and not config.bf16
    assert not loss_scale.dynamic(parse_args(["--fp16", "--loss-scale", "1024"]))
    assert loss_scale.dynamic(parse_args(["--fp16", "--loss-scale", "0"]))  # Megatron-LM's 0


def _fp16_part(group, hysteresis=1):
    """megatron-core's fp16 optimizer over one fp16 parameter (ones), SGD with lr 0.5, its
    own DynamicGradScaler at 8."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    param = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    config = OptimizerConfig(fp16=True, optimizer="sgd", lr=0.5, clip_grad=0.0,
                             params_dtype=torch.float16)
    scaler = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_factor=2.0,
                               backoff_factor=0.5, growth_interval=1000, hysteresis=hysteresis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        part = Float16OptimizerWithFloat16Params(torch.optim.SGD([param], lr=0.5), config,
                                                 scaler, None)
    part.grad_stats_parallel_group = part.tp_group = group
    return param, part


def test_dense_and_expert_optimizers_share_one_scale(one_rank_gloo):
    """With MoE layers megatron-core chains a dense and an expert optimizer, each with a
    scaler. The dense gradients overflow, the experts' do not: the step is skipped, and the one
    scale both parts unscale by halves (hysteresis 1), as megatron-core's DynamicGradScaler
    given that step's overflow does. The next step's gradients, scaled by the loss scale the
    schedule used (the chained optimizer's), move both parameters alike."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    (dense, dense_part), (expert, expert_part) = (_fp16_part(one_rank_gloo) for _ in range(2))
    optimizer = loss_scale.one_scaler(ChainedOptimizer([dense_part, expert_part]))
    reference = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=1000, hysteresis=1)
    dense.grad = torch.full((3,), float("inf"), dtype=torch.float16)
    expert.grad = torch.ones(3, dtype=torch.float16)
    assert optimizer.step() == (False, None, None)
    reference.update(True)
    for part in (dense_part, expert_part, optimizer):
        assert part.get_loss_scale().item() == reference.scale.item() == 4.0
    scale = optimizer.get_loss_scale().item()
    for param in (dense, expert):  # a gradient of 1 per element, times the loss scale
        param.grad = torch.full((3,), scale, dtype=torch.float16)
    assert optimizer.step()[0]
    assert torch.equal(dense.detach(), torch.full((3,), 0.5, dtype=torch.float16))
    assert torch.equal(expert.detach(), dense.detach())  # megatron-core alone: 0.75 (1 - 0.5/2)


def test_fp16_trains_like_fp32(gpt_data, tmp_path):
    """An MoE GPT on MP2 x EP2 in fp16 with a static --loss-scale: its losses and gradient
    norms are the fp32 run's within fp16's rounding; the scale is megatron-core's
    ConstantGradScaler's, and no step overflows."""
    fp32 = launch(2, tiny_gpt_args(gpt_data, **MP2_EP2), tmp_path)
    fp16 = launch(2, tiny_gpt_args(gpt_data, **MP2_EP2, fp16=True, **{"loss-scale": 1024}),
                  tmp_path)
    for run in (fp32, fp16):
        assert run.returncode == 0, run.output[-4000:]
        assert len(run.loss()) == 10
    assert loss_scale.LOSS_SCALE not in fp32.losses[0]  # no scaler, no column
    assert fp16.loss(loss_scale.LOSS_SCALE) == [1024.0] * 10
    assert fp16.loss(loss_scale.SKIPPED) == [0.0] * 10
    assert max_relative(fp16.loss(), fp32.loss()) < FP16_VS_FP32
    assert max_relative(fp16.loss("grad norm"), fp32.loss("grad norm")) < 10 * FP16_VS_FP32
    assert fp16.loss()[-1] < fp16.loss()[0] - 0.2  # it trains
    assert "| loss scale 1024.0 | number of skipped iterations 0 |" in fp16.output


def _skipped_each_step(rows, log_interval: int) -> list:
    """Whether each iteration was skipped, from the running count of the log interval."""
    flags, before = [], 0
    for row in rows:
        count = int(row[loss_scale.SKIPPED])
        flags.append(count - before == 1)
        assert count - before in (0, 1), rows
        before = 0 if row["iteration"] % log_interval == 0 else count
    return flags


def _expected_lrs(skipped: list, train_iters: int) -> list:
    """megatron-core's OptimizerParamScheduler as the run builds it, stepped only where the
    step was not skipped (Megatron-LM's train_step)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    groups = types.SimpleNamespace(param_groups=[{}])
    schedule = OptimizerParamScheduler(groups, init_lr=LR, max_lr=LR, min_lr=0.0,
                                       lr_warmup_steps=0, lr_decay_steps=train_iters,
                                       lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                       wd_incr_steps=train_iters, wd_incr_style="constant")
    lrs = []
    for was_skipped in skipped:
        if not was_skipped:
            schedule.step(1)
        lrs.append(schedule.get_lr(groups.param_groups[0]))
    return lrs


def _check_against_megatron_core(run, patched) -> list:
    """The overflowing run's logged scale and LR, step by step, against megatron-core's
    DynamicGradScaler and OptimizerParamScheduler given its overflows; returns them."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    rows = run.losses
    assert [row["iteration"] for row in rows] == list(range(1, 25)), run.output[-4000:]
    skipped = _skipped_each_step(rows, OVERFLOWING["log-interval"])
    # megatron-core reports no gradient norm for a skipped step
    assert skipped == [row["grad norm"] != row["grad norm"] for row in rows]
    reference = DynamicGradScaler(initial_scale=2.0**32, min_scale=1.0, growth_factor=2.0,
                                  backoff_factor=0.5, growth_interval=3, hysteresis=2)
    for row, was_skipped in zip(rows, skipped):
        reference.update(was_skipped)
        assert row[loss_scale.LOSS_SCALE] == reference.scale.item(), (row, skipped)
    assert [row["lr"] for row in rows] == pytest.approx(_expected_lrs(skipped, 24), rel=1e-12)
    return skipped


def _check_log_lines(run) -> None:
    """Each log line's loss scale and skipped count (of its 4 iterations) are the metrics'."""
    logged = re.findall(r"iteration +(\d+)/24 \|.*?\| loss scale ([\d.]+) \| number of skipped "
                        r"iterations (\d+) \|", run.output)
    assert [int(i) for i, _, _ in logged] == [4, 8, 12, 16, 20, 24], run.output[-3000:]
    for iteration, scale, count in logged:
        row = run.losses[int(iteration) - 1]
        assert (float(scale), int(count)) == (row[loss_scale.LOSS_SCALE],
                                              row[loss_scale.SKIPPED])


def test_overflowing_steps_are_skipped_as_megatron_core_scales(gpt_data, tmp_path, patched):
    """Dynamic loss scaling from 2**32 on PP2 with megatron's MoE layer and the distributed
    optimizer: the first steps overflow and are skipped (grad norm NaN, the LR schedule held)
    until the scale is low enough, then the scale grows every 3 clean steps; each step's scale
    and LR are megatron-core's. Resumed from the checkpoint of
    iteration 15 (the scaler's trackers mid-window), the run goes on exactly as it did."""
    # iteration 6's loss reads NaN: under dynamic scaling that is the scaler's business, not
    # the end of the run (Megatron-LM turns its NaN check off there)
    run = launch(2, tiny_gpt_args(gpt_data, **OVERFLOWING, save=tmp_path / "ckpt"), tmp_path,
                 env={"PARM_FAULT": "nan:iter=6"})
    assert run.returncode == 0, run.output[-4000:]
    assert math.isnan(run.loss()[5]) and not any(map(math.isnan, run.loss()[6:]))
    skipped = _check_against_megatron_core(run, patched)
    first_update = skipped.index(False)
    assert first_update >= 2 and all(skipped[:first_update])  # hysteresis 2, then halving
    scales = run.loss(loss_scale.LOSS_SCALE)
    assert any(later > earlier for earlier, later in zip(scales, scales[1:]))  # it grew back
    assert run.loss()[-1] < run.loss()[first_update] - 0.1
    _check_log_lines(run)

    at_15 = tmp_path / "at_15"
    at_15.mkdir()
    (at_15 / "iter_0000015").symlink_to(tmp_path / "ckpt" / "iter_0000015")
    (at_15 / TRACKER).write_text("15")
    flags = {k: v for k, v in OVERFLOWING.items() if k != "save-interval"}
    resumed = launch(2, tiny_gpt_args(gpt_data, **flags, load=at_15), tmp_path)
    assert f"resumed from {at_15} at iteration 15" in resumed.output, resumed.output[-4000:]
    # everything as logged, but the skipped count of iteration 16's interval, which a resumed
    # run counts from its start (as Megatron-LM's does)
    without_count = [{k: v for k, v in row.items() if k != loss_scale.SKIPPED}
                     for row in resumed.losses]
    assert without_count == [{k: v for k, v in row.items() if k != loss_scale.SKIPPED}
                             for row in run.losses[15:]]
    assert [row[loss_scale.SKIPPED] for row in resumed.losses[1:]] == \
        [row[loss_scale.SKIPPED] for row in run.losses[16:]]
