"""Flag parsing (parm_trainer/arguments/) in one process: derived defaults, contradictions,
and --help (every flag with its help)."""

import argparse
import atexit
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# `pretrain_gpt_moe.py --help` starts now, at collection, so that its imports (torch and
# megatron-core, several seconds) overlap with this process's own; test_help_runs reads it.
_HELP = subprocess.Popen([sys.executable, "pretrain_gpt_moe.py", "--help"], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@atexit.register
def _end_help_process():
    if _HELP.poll() is None:
        _HELP.kill()
    _HELP.communicate()


import torch  # noqa: E402

from parm_trainer.arguments import ArgumentsError, build_parser, parse_args  # noqa: E402

MOE = ["--num-experts", "4", "--disable-bias-linear"]


# --- parse_args: derived defaults and contradictions --------------------------------------------


def test_derived_defaults():
    args = parse_args(["--hidden-size", "64", "--seq-length", "32", "--train-iters", "50"],
                      world_size=1)
    assert args.ffn_hidden_size == 4 * 64
    assert args.moe_ffn_hidden_size == 4 * 64  # follows --ffn-hidden-size
    assert args.max_position_embeddings == 32
    assert args.expert_tensor_parallel_size == 1  # follows --tensor-model-parallel-size
    assert args.lr_decay_iters == 50
    assert args.params_dtype == torch.float32
    assert args.world_size == 1


def test_derived_defaults_follow_other_flags():
    args = parse_args(["--hidden-size", "64", "--ffn-hidden-size", "100",
                       "--tensor-model-parallel-size", "2"], world_size=2)
    assert args.ffn_hidden_size == 100
    assert args.moe_ffn_hidden_size == 100
    assert args.expert_tensor_parallel_size == 2


def test_explicit_values_win_over_derived_defaults():
    args = parse_args(["--hidden-size", "64", "--moe-ffn-hidden-size", "48",
                       "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                       "--train-iters", "50", "--lr-decay-iters", "40",
                       "--max-position-embeddings", "512"], world_size=2)
    assert args.ffn_hidden_size == 256
    assert args.moe_ffn_hidden_size == 48
    assert args.expert_tensor_parallel_size == 1
    assert args.lr_decay_iters == 40
    assert args.max_position_embeddings == 512


def test_overlap_grad_reduce_off_unless_asked_and_the_last_flag_wins():
    assert parse_args([], world_size=1).overlap_grad_reduce is False  # as Megatron-LM
    assert parse_args(["--overlap-grad-reduce"], world_size=1).overlap_grad_reduce is True
    assert parse_args(["--overlap-grad-reduce", "--no-overlap-grad-reduce"],
                      world_size=1).overlap_grad_reduce is False
    assert parse_args([], world_size=1).overlap_moe_expert_parallel_comm is False
    flags = ["--overlap-moe-expert-parallel-comm", "--no-overlap-moe-expert-parallel-comm"]
    assert parse_args(flags, world_size=1).overlap_moe_expert_parallel_comm is False


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert parse_args([]).world_size == 8
    assert parse_args([], world_size=2).world_size == 2


@pytest.mark.parametrize("argv,flag", [
    (["--train-iters", "100", "--lr-warmup-iters", "100"], "--lr-warmup-iters"),
    (["--train-iters", "100", "--lr-decay-iters", "10", "--lr-warmup-iters", "20"],
     "--lr-warmup-iters"),
    (["--use-distributed-optimizer", "--optimizer", "sgd"], "--use-distributed-optimizer"),
    (["--train-iters", "0"], "--train-iters"),
    (["--log-interval", "0"], "--log-interval"),
    (["--eval-interval", "0"], "--eval-interval"),
], ids=["warmup_eq_train", "warmup_over_decay", "distopt_sgd", "train_zero", "log_zero",
        "eval_zero"])
def test_contradictory_flags(argv, flag):
    with pytest.raises(ArgumentsError, match=flag):
        parse_args(argv, world_size=1)


def test_warmup_below_decay_is_fine():
    args = parse_args(["--train-iters", "100", "--lr-warmup-iters", "99"], world_size=1)
    assert args.lr_warmup_iters == 99 and args.lr_decay_iters == 100


# --- --help (last: its subprocess, _HELP, started at collection and ran beside the tests) ----------


def test_help_runs():
    stdout, stderr = _HELP.communicate(timeout=120)
    assert _HELP.returncode == 0, stderr[-3000:]
    for flag in ("--tensor-model-parallel-size", "--expert-tensor-parallel-size",
                 "--moe-router-topk", "--global-batch-size", "--data-path"):
        assert flag in stdout


def test_every_flag_has_help():
    parser = build_parser()
    flags = [action for action in parser._actions if action.option_strings]
    assert len(flags) > 50
    missing = [action.option_strings[0] for action in flags
               if not action.help or action.help == argparse.SUPPRESS or not action.help.strip()]
    assert not missing, f"flags without help: {missing}"
