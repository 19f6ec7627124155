"""Layout checks (parm_trainer/planning/checks.py) in one process: layouts that run, with the
sizes they imply, and layouts that cannot, each refused with one line naming its flag."""

import pytest

from parm_trainer.arguments import ArgumentsError, parse_args
from parm_trainer.errors import LayoutError
from parm_trainer.planning.checks import validate_layout

MOE = ["--num-experts", "4", "--disable-bias-linear"]



def layout(world, *argv):
    args = parse_args(list(argv), world_size=world)
    validate_layout(args)
    return args



# --- validate_layout: layouts that run ----------------------------------------------------------

# (id, world size, flags, expected data-parallel size, expected micro-batches per step)
GOOD_LAYOUTS = [
    ("one_rank_dense", 1, [], 1, 1),
    ("one_rank_moe", 1, [*MOE, "--global-batch-size", "8"], 1, 4),
    ("dp4_default_global_batch", 4, [*MOE, "--expert-model-parallel-size", "4"], 4, 1),
    ("tp2_ep2_esp2_on_4", 4,
     [*MOE, "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
      "--expert-tensor-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "16"],
     2, 4),
    ("tp2_ep2_esp1_on_4", 4,
     [*MOE, "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
      "--expert-tensor-parallel-size", "1", "--sequence-parallel", "--global-batch-size", "8"],
     2, 2),
    ("pp2_on_2", 2,
     ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--global-batch-size", "8"],
     1, 4),
    ("tp2_ep4_on_8", 8,
     ["--num-experts", "8", "--disable-bias-linear", "--tensor-model-parallel-size", "2",
      "--expert-model-parallel-size", "4", "--sequence-parallel", "--global-batch-size", "32"],
     4, 4),
    ("tp2_pp2_ep2_on_8", 8,
     [*MOE, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
      "--expert-model-parallel-size", "2", "--sequence-parallel", "--num-layers", "4",
      "--micro-batch-size", "1", "--global-batch-size", "4"],
     2, 2),
    ("moe_s1_schedule_tp2_without_sp", 2,
     [*MOE, "--tensor-model-parallel-size", "2", "--moe-parm-schedule", "s1"], 1, 1),
    ("esp2_tp1_on_2", 2,
     [*MOE, "--expert-tensor-parallel-size", "2", "--global-batch-size", "4"], 2, 1),
    ("top1_pre_softmax", 1, [*MOE, "--moe-router-topk", "1", "--moe-router-pre-softmax"], 1, 1),
]


@pytest.mark.parametrize("world,argv,dp,micro", [c[1:] for c in GOOD_LAYOUTS],
                         ids=[c[0] for c in GOOD_LAYOUTS])
def test_good_layout(world, argv, dp, micro):
    args = layout(world, *argv)
    assert args.data_parallel_size == dp
    assert args.num_microbatches == micro
    assert args.global_batch_size == micro * dp * args.micro_batch_size


# --- validate_layout: layouts that cannot run, each naming its flag ------------------------------

# (id, world size, flags, fragment of the message; it starts with the flag to change)
BAD_LAYOUTS = [
    ("tp3_on_4", 4, ["--tensor-model-parallel-size", "3"],
     "--tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1 = 3 does not divide "
     "the world size 4"),
    ("experts5_ep2", 2, ["--num-experts", "5", "--expert-model-parallel-size", "2",
                         "--disable-bias-linear"],
     "--num-experts 5 is not divisible by --expert-model-parallel-size 2"),
    ("heads_vs_tp", 4, ["--tensor-model-parallel-size", "4", "--num-attention-heads", "6",
                        "--hidden-size", "96"],
     "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    ("layers_vs_pp", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "3"],
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    ("moe_ffn_vs_esp", 4, [*MOE, "--expert-tensor-parallel-size", "4",
                           "--moe-ffn-hidden-size", "130"],
     "--moe-ffn-hidden-size 130 is not divisible by --expert-tensor-parallel-size 4"),
    ("moe_megatron_schedule_tp2_without_sp", 2,
     [*MOE, "--tensor-model-parallel-size", "2", "--moe-parm-schedule", "megatron"],
     "needs --sequence-parallel"),
    ("expert_biases_with_esp2", 2, ["--num-experts", "4", "--expert-tensor-parallel-size", "2"],
     "add --disable-bias-linear"),
    ("global_batch_vs_micro_dp", 2, ["--micro-batch-size", "2", "--global-batch-size", "6"],
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2"),
    ("topk_over_experts", 1, [*MOE, "--moe-router-topk", "5"],
     "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    ("top1_without_pre_softmax", 1, [*MOE, "--moe-router-topk", "1"],
     "--moe-router-topk 1 needs --moe-router-pre-softmax"),
    ("ep_without_experts", 2, ["--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size > 1 needs --num-experts"),
    ("esp_ep_vs_world", 4, [*MOE, "--expert-model-parallel-size", "4",
                            "--expert-tensor-parallel-size", "2"],
     "--expert-tensor-parallel-size 2 x --expert-model-parallel-size 4 x"),
    ("hidden_vs_heads", 1, ["--hidden-size", "100", "--num-attention-heads", "8"],
     "--hidden-size 100 is not divisible by --num-attention-heads 8"),
    ("seq_vs_tp_under_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--seq-length", "63"],
     "--seq-length 63 is not divisible by --tensor-model-parallel-size 2"),
    ("tp_zero", 1, ["--tensor-model-parallel-size", "0"],
     "--tensor-model-parallel-size must be at least 1"),
]


@pytest.mark.parametrize("world,argv,fragment", [c[1:] for c in BAD_LAYOUTS],
                         ids=[c[0] for c in BAD_LAYOUTS])
def test_bad_layout_names_the_flag(world, argv, fragment):
    """Refused by validate_layout, or already by parse_args (a size below its range)."""
    with pytest.raises((LayoutError, ArgumentsError)) as error:
        validate_layout(parse_args(argv, world_size=world))
    assert fragment in str(error.value), str(error.value)


def test_micro_batch_zero_is_a_layout_error():
    with pytest.raises((LayoutError, ArgumentsError), match="--micro-batch-size"):
        layout(1, "--micro-batch-size", "0")


@pytest.mark.parametrize("global_batch", ["0", "-4"])
def test_non_positive_global_batch_is_a_layout_error(global_batch):
    with pytest.raises((LayoutError, ArgumentsError), match="--global-batch-size"):
        layout(2, "--global-batch-size", global_batch)
