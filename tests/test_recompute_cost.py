"""The start-up memory estimate under activation recomputation (planning/recompute_cost.py), in
this process: each choice keeps less than the run without it, in the order the memory probe
measures them (tests/test_recompute.py checks the figures against the probe), and full
recompute's recomputed unit is counted alive again once, after the pieces behind it let go."""

import pytest

from parm_trainer.arguments import parse_args
from parm_trainer.planning.checks import validate_layout
from parm_trainer.planning.memory_estimate import estimate
from parm_trainer.planning.model_cost import Piece
from parm_trainer.planning.recompute_cost import full, transient

MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads",
         "4", "--seq-length", "512", "--max-position-embeddings", "512", "--num-experts", "8",
         "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512", "--swiglu",
         "--micro-batch-size", "4", "--global-batch-size", "8", "--disable-bias-linear",
         "--expert-model-parallel-size", "2", "--moe-parm-schedule", "s1",
         "--moe-parm-chunks", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules"]


def activations(*flags) -> float:
    args = parse_args([*MODEL, *flags], world_size=2)
    validate_layout(args)
    args.padded_vocab_size = 2048
    return estimate(args)[0][0]["activations"]


def test_each_choice_keeps_less():
    none = activations()
    every_layer = activations("--recompute-granularity", "full", "--recompute-method",
                              "uniform", "--recompute-num-layers", "1")
    half = activations("--recompute-granularity", "full", "--recompute-method", "block",
                       "--recompute-num-layers", "2")
    parm, megatron = activations(*SELECTIVE, "moe"), activations(
        *SELECTIVE, "moe", "--moe-parm-schedule", "megatron")
    attention = activations(*SELECTIVE, "core_attn")
    both = activations("--moe-layer-recompute")
    assert every_layer < none / 2 < half < none  # measured: 0.26 and 0.54 of it
    assert both < parm < attention < none and both < attention
    assert megatron < parm < none / 2 * 1.1  # Parm keeps the rows its exchange received
    assert activations(*SELECTIVE, "layernorm") == none  # as the probe sees it


def test_full_recompute_counts_one_unit_alive_again():
    run = [Piece("E", 1, 2, 0, 0, 10.0), *[Piece("m", 1, 2, 0, 0, 100.0) for _ in range(4)],
           Piece("L", 1, 2, 0, 0, 50.0)]

    class Args:
        recompute_granularity, recompute_method, recompute_num_layers = "full", "uniform", 2

    (priced,) = full(Args, [run], 5.0)
    assert [p.activation_bytes for p in priced] == [10.0, 5.0, 0.0, 5.0, 0.0, 50.0]
    assert [p.backward_s for p in priced] == [2, 3, 3, 3, 3, 2]  # the forward again
    # the last unit's 195 bytes again while only the head's 50 are let go; the first's 195
    # after 55 more
    assert transient(priced) == pytest.approx(195.0 - 50.0)
    Args.recompute_method, Args.recompute_num_layers = "block", 1
    (priced,) = full(Args, [run], 5.0)
    assert [p.activation_bytes for p in priced] == [10.0, 5.0, 100.0, 100.0, 100.0, 50.0]
    assert transient(priced) == 0.0  # layer 0's 95 again after 350 let go
