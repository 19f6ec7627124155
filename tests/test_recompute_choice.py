"""The planner's recomputation under --memory-gb (planning/recompute_choice.py) and the time each
recompute setting adds (recompute_cost.selective_s, recompute_cost.full), in this process.

- The time: on megatron-core's model as the project builds it, the FLOPs torch's counter sees in
  one forward and backward with a setting, less those without it (what the code really runs
  again), against the cost model's added backward under a profile that prices GEMM FLOPs only.
- The choice: a limit between the plain split's estimate and full recompute's makes
  stages.auto_layout pick the setting of least predicted time among those that fit (each
  alternative priced directly), sets args' recompute fields as the flags would and logs it; a
  looser limit picks none, the user's own flags are never overridden, an impossible limit is
  refused naming recomputation.
"""

import pytest
import torch

from test_models_init import build_tiny
from test_planning import NO_DROPOUT, _flop_profile

from parm_trainer.arguments import parse_args
from parm_trainer.moe.cost_profile import DEFAULT_PROFILE
from parm_trainer.planning import recompute_choice, recompute_cost
from parm_trainer.planning.checks import validate_layout
from parm_trainer.planning.layout import check_pipeline
from parm_trainer.planning.model_cost import ModelCost
from parm_trainer.planning.recompute_choice import Setting, selective_settings, with_setting
from parm_trainer.planning.stages import NoSplitFits, auto_layout, layout_string, price_split

SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules"]
FULL = ["--recompute-granularity", "full", "--recompute-method"]


def _flops(args, model) -> float:
    """Forward and backward GEMM FLOPs of one micro-batch, as torch counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    from parm_trainer.moe.layer import mlp_recompute_to_parm

    mlp_recompute_to_parm(model)  # as training/setup.py builds it
    tokens = torch.randint(0, 1024, (2, args.seq_length))
    position = torch.arange(args.seq_length).expand(2, -1)
    with FlopCounterMode(display=False) as counter:
        model(tokens, position, None, labels=tokens).sum().backward()
    return counter.get_total_flops()


def _predicted(args) -> float:
    args.padded_vocab_size = 1024
    cost = ModelCost(args, _flop_profile(), moe_schedule=("s1", 1))
    run = recompute_cost.full(args, [cost.pieces()], recompute_cost.kept_input(cost))[0]
    return sum(p.total_s for p in run)


@pytest.mark.parametrize("flags", [
    [*SELECTIVE, "core_attn"], [*SELECTIVE, "mlp"], [*SELECTIVE, "moe"],
    [*SELECTIVE, "shared_experts"], [*SELECTIVE, "core_attn", "mlp", "moe"],
    [*SELECTIVE, "moe", "--moe-parm-schedule", "megatron"],
    [*FULL, "uniform", "--recompute-num-layers", "1"],
    [*FULL, "block", "--recompute-num-layers", "1"]])
def test_added_time_is_the_forward_the_code_runs_again(one_rank_world, flags):
    base = ["--micro-batch-size", "2", "--moe-layer-freq", "2",  # layers: MoE, dense
            "--ffn-hidden-size", "128", "--moe-shared-expert-intermediate-size", "64",
            "--swiglu", *NO_DROPOUT]
    if "megatron" in flags:
        base += ["--moe-parm-schedule", "megatron"]
    plain_args, plain_model = build_tiny(1, *base)
    args, model = build_tiny(1, *base, *flags)
    again = _flops(args, model) - _flops(plain_args, plain_model)
    assert again > 0
    assert _predicted(args) - _predicted(plain_args) == pytest.approx(again, rel=0.02)


MODEL = ["--mock-data", "--num-layers", "8", "--hidden-size", "128", "--num-attention-heads",
         "4", "--seq-length", "1024", "--max-position-embeddings", "1024", "--num-experts", "8",
         "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512", "--swiglu",
         "--moe-layer-freq", "2", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--disable-bias-linear", "--pipeline-model-parallel-size", "2",
         "--pipeline-model-parallel-layout", "auto", *NO_DROPOUT]


def _args(*flags):
    args = parse_args([*MODEL, *flags], world_size=2)
    validate_layout(args)
    args.padded_vocab_size = 2048
    check_pipeline(args)
    return args


def _price(args, setting=None, limit=None):
    trial = with_setting(args, setting) if setting else args
    return price_split(trial, ModelCost(trial, DEFAULT_PROFILE), 2, 1, 8, limit)


def _every_setting(args) -> list:
    per_stage = args.num_layers // 2
    return (selective_settings(args)
            + [Setting("full", method="block", layers=n) for n in range(1, per_stage)]
            + [Setting("full", method="uniform", layers=n) for n in (1, per_stage)])


def test_a_limit_between_plain_and_full_picks_the_fastest_setting_that_fits():
    plain = _price(_args())
    every = [Setting("full", method="uniform", layers=1)]
    least = _price(_args(), every[0])
    assert least.memory_bytes < plain.memory_bytes / 3
    chosen = {}
    for fraction in (0.02, 0.3, 0.6, 0.8):
        gb = (least.memory_bytes + fraction * (plain.memory_bytes - least.memory_bytes)) / 2**30
        args, lines = _args("--memory-gb", str(gb)), []
        layout = auto_layout(args, log=lines.append)
        # every alternative priced directly, each split under the limit (None: the plain)
        fitting = {}
        for setting in [None, *_every_setting(args)]:
            try:
                priced = _price(_args(), setting, gb * 2**30)
            except NoSplitFits:
                continue
            if priced.memory_bytes <= gb * 2**30:
                fitting[setting] = priced
        best = min(fitting, key=lambda s: fitting[s].iteration_s)
        assert best is not None and str(best) in lines[0], (fraction, lines)
        chosen[fraction] = best
        for name in recompute_choice.FIELDS:  # as the flags set them
            assert getattr(args, name) == getattr(with_setting(_args(), best), name), name
        assert layout == layout_string(fitting[best].runs)
        assert f"needs an estimated {plain.memory_bytes / 2**30:.3g} GiB" in lines[0]
        assert fitting[best].iteration_s > plain.iteration_s  # recomputation costs time
    # the choice moves with the limit: full recompute at the tightest, selective at the loosest
    assert chosen[0.02].granularity == "full" and chosen[0.8].granularity == "selective", chosen


def test_a_loose_limit_picks_none_and_the_users_flags_stay():
    plain = _price(_args())
    args, lines = _args("--memory-gb", str(plain.memory_bytes * 1.01 / 2**30)), []
    assert auto_layout(args, log=lines.append) == layout_string(plain.runs)
    assert args.recompute_granularity is None and len(lines) == 1
    # the user's own recompute is priced as given, never replaced, even where it does not fit
    given = ["--recompute-granularity", "selective", "--recompute-modules", "moe"]
    mine = _price(_args(*given))
    for fraction in (0.9, 0.5):  # a slower split that fits, or none (refused as before)
        args = _args(*given, "--memory-gb", str(mine.memory_bytes * fraction / 2**30))
        try:
            auto_layout(args, log=lines.append)
        except NoSplitFits as error:
            assert "recomputation" not in str(error)
        assert args.recompute_modules == ["moe"] and args.recompute_method is None
    assert not any(line.startswith("--memory-gb") for line in lines)


def test_an_impossible_limit_is_refused_naming_recomputation():
    with pytest.raises(NoSplitFits, match=r"^no split into 2 stages fits the memory limit of "
                       r"0.01 GiB per rank, nor with activation recomputation \(tried \d+ "):
        auto_layout(_args("--memory-gb", "0.01"), log=print)
    least = min(_price(_args(), setting).memory_bytes for setting in _every_setting(_args()))
    args = _args("--memory-gb", str(least * 0.999 / 2**30))
    with pytest.raises(NoSplitFits, match="nor with activation recomputation"):
        auto_layout(args, log=print)
    assert args.recompute_granularity is None
