"""python -m pytest tests/test_units.py -q

Fast single-process unit tests (no torchrun): layout checks, flag parsing, vocabulary padding,
the FLOPs formula, the pretraining sampler's order, and the layout-free weight initialisation on
a tiny megatron GPTModel in a one-rank gloo world.

Over 500 lines on purpose: many small checks that share one process (and megatron-core's
import, seconds on this machine) instead of one per topic.
"""

import argparse
import atexit
import math
import subprocess
import sys
import warnings
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
import torch.distributed as dist  # noqa: E402

from parm_trainer.arguments import ArgumentsError, build_parser, parse_args  # noqa: E402
from parm_trainer.parallel import LayoutError, validate_layout  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core: optional GPU extensions missing
    from parm_trainer.models.config import padded_vocab_size
    from parm_trainer.training.data import PretrainingSampler
    from parm_trainer.training.flops import flops_per_iteration

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


# --- padded_vocab_size ----------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 127, 128, 129, 2000, 8000, 32000, 50257, 151936])
def test_padded_vocab_size_is_layout_free(vocab):
    padded = {tp: padded_vocab_size(vocab, tp) for tp in (1, 2, 4, 8)}
    assert len(set(padded.values())) == 1, padded
    value = padded[1]
    assert value % 128 == 0
    assert all(value % tp == 0 for tp in (1, 2, 4, 8))
    assert vocab <= value < vocab + 128


def test_padded_vocab_size_unusual_tp():
    for tp in (3, 6):
        value = padded_vocab_size(2000, tp)
        assert value % 128 == 0 and value % tp == 0 and 2000 <= value < 2000 + 128 * tp

    # --make-vocab-size-divisible-by (Megatron-LM's flag) sets the multiple
    assert padded_vocab_size(8000, 2, 32000) == 32000
    assert padded_vocab_size(8000, 3, 1000) == 9000


# --- flops_per_iteration ----------------------------------------------------------------------------


def flops_args(*argv, world=1):
    return layout(world, "--hidden-size", "64", "--seq-length", "32", "--num-layers", "2",
                  "--micro-batch-size", "2", "--global-batch-size", "4", *argv)


def test_flops_dense_by_hand():
    args = flops_args("--ffn-hidden-size", "256")
    h, s, L, F, V, B = 64, 32, 2, 256, 1024, 4
    # Per token and layer, forward, 2 FLOPs per multiply-add:
    qkvo = 4 * (2 * h * h)          # four h x h projections
    scores = 2 * s * h + 2 * s * h  # Q K^T over s keys, then the weighted sum of s values
    mlp = 2 * (2 * h * F)           # fc1 (h -> F) and fc2 (F -> h), no gate
    logits = 2 * h * V
    forward_per_token = L * (qkvo + scores + mlp) + logits
    assert forward_per_token == 2 * (32768 + 8192 + 65536) + 131072 == 344064
    expected = 3 * forward_per_token * (B * s)  # forward + backward (2x forward)
    assert flops_per_iteration(args, vocab_size=V) == expected == 132_120_576


def test_flops_reads_padded_vocab_from_args():
    args = flops_args("--ffn-hidden-size", "256")
    args.padded_vocab_size = 1024
    assert flops_per_iteration(args) == flops_per_iteration(args, vocab_size=1024)


def test_flops_moe_top1_equals_dense_plus_router():
    E, H, V, h, s, L, B = 8, 96, 512, 64, 32, 2, 4
    moe = flops_args("--num-experts", str(E), "--moe-router-topk", "1",
                     "--moe-router-pre-softmax", "--moe-ffn-hidden-size", str(H),
                     "--disable-bias-linear")
    dense = flops_args("--ffn-hidden-size", str(H))
    router = 3 * L * (2 * h * E) * (B * s)
    assert flops_per_iteration(moe, V) == flops_per_iteration(dense, V) + router


def test_flops_moe_swiglu_topk2_by_hand():
    E, H, V, h, s, L, B, k = 4, 48, 256, 64, 32, 4, 4, 2
    args = flops_args("--num-layers", str(L), "--num-experts", str(E), "--moe-router-topk",
                      str(k), "--moe-ffn-hidden-size", str(H), "--ffn-hidden-size", "160",
                      "--moe-layer-freq", "2", "--swiglu", "--disable-bias-linear")
    attention = 8 * h * h + 4 * s * h
    moe_mlp = 2 * h * E + k * (3 * 2 * h * H)  # router + k experts of three h x H matrices
    dense_mlp = 3 * 2 * h * 160                # layers 1 and 3 stay dense
    forward_per_token = L * attention + 2 * moe_mlp + 2 * dense_mlp + 2 * h * V
    assert flops_per_iteration(args, V) == 3 * forward_per_token * B * s


# --- PretrainingSampler -----------------------------------------------------------------------------


def micro_batches(total, consumed, micro, rank, size):
    return list(PretrainingSampler(total, consumed, micro, rank, size))


def test_sampler_grouping_is_layout_free():
    total, micro, global_batch = 40, 2, 8
    single = micro_batches(total, 0, micro, 0, 1)
    rank0 = micro_batches(total, 0, micro, 0, 2)
    rank1 = micro_batches(total, 0, micro, 1, 2)
    assert single[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the first step, 4 micro-batches
    interleaved = [batch for pair in zip(rank0, rank1) for batch in pair]
    assert interleaved == single
    # each step of the DP=2 run (2 micro-steps) covers exactly one global batch
    steps = [sorted(sum(interleaved[i:i + global_batch // micro], []))
             for i in range(0, len(interleaved), global_batch // micro)]
    assert steps == [list(range(k * global_batch, (k + 1) * global_batch))
                     for k in range(total // global_batch)]


def test_sampler_resume_continues_where_a_fresh_one_is():
    total, micro = 40, 2
    for size in (1, 2, 4):
        per_step = micro * size
        for rank in range(size):
            fresh = micro_batches(total, 0, micro, rank, size)
            resumed = micro_batches(total, 8, micro, rank, size)
            assert resumed == fresh[8 // per_step:], (size, rank)
    assert micro_batches(total, 8, micro, 0, 1)[0] == [8, 9]


def test_sampler_drops_incomplete_tail():
    batches = micro_batches(10, 0, 2, 1, 2)
    assert batches == [[2, 3], [6, 7]]
    assert all(i < 10 for b in micro_batches(10, 0, 2, 0, 2) for i in b)


def test_sampler_empty_dataset():
    with pytest.raises(ValueError, match="empty"):
        PretrainingSampler(0, 0, 2, 0, 1)


# --- init_weights_layout_free on a tiny megatron GPTModel ---------------------------------------------

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-experts", "4", "--moe-ffn-hidden-size", "512", "--seq-length", "64",
        "--disable-bias-linear", "--moe-parm-schedule", "s1", "--moe-parm-chunks", "1"]
VOCAB = 1024
STD = 0.02


@pytest.fixture(scope="module")
def one_rank_world():
    """A one-rank gloo world with megatron's process groups, torn down after this module."""
    from megatron.core import parallel_state

    from parm_trainer.compat import cpu

    cpu.apply()
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def build_tiny(megatron_seed, *extra):
    """Build the model with megatron's own init drawn from `megatron_seed`."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from parm_trainer.models.config import transformer_config
    from parm_trainer.models.gpt import build_gpt_moe

    args = layout(1, *TINY, *extra)
    torch.manual_seed(megatron_seed)
    model_parallel_cuda_manual_seed(megatron_seed)
    return args, build_gpt_moe(args, transformer_config(args), VOCAB)


def initialised(seed, megatron_seed, *extra):
    from parm_trainer.models.init import init_weights_layout_free

    args, model = build_tiny(megatron_seed, *extra)
    written = init_weights_layout_free(model, seed, STD, args.num_layers)
    return written, dict(model.named_parameters())


@pytest.mark.parametrize("schedule", ["s1", "megatron"])
def test_init_is_deterministic(one_rank_world, schedule):
    extra = ("--moe-parm-schedule", schedule)
    raw_a = dict(build_tiny(1, *extra)[1].named_parameters())
    raw_b = dict(build_tiny(2, *extra)[1].named_parameters())
    assert any(not torch.equal(raw_a[k], raw_b[k]) for k in raw_a if raw_a[k].dim() >= 2), \
        "megatron's own init should differ between the two builds, or the test proves nothing"

    written, a = initialised(7, 1, *extra)
    _, b = initialised(7, 2, *extra)
    _, c = initialised(8, 1, *extra)
    matrices = [k for k, p in a.items() if p.dim() >= 2]
    assert written == len(matrices)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: same seed, different weights"
    for name in matrices:
        assert not torch.equal(a[name], c[name]), f"{name}: different seeds, same weights"


def test_auto_times_every_schedule_on_the_same_weights(one_rank_world):
    """auto's start-up measurement builds one layer per schedule: all carry the same router
    and expert weights (so both schedules route the same tokens to the same experts), where
    two plain builds draw different ones."""
    from parm_trainer.models.config import transformer_config
    from parm_trainer.moe import tune

    args = layout(1, *TINY)
    config, cpu = transformer_config(args), torch.device("cpu")

    def same(a, b):  # a state entry is a tensor, or None (extra state)
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    raw = [tune._build(args, config, name, cpu).state_dict() for name in ("s1", "s2")]
    assert any(not same(raw[0][k], raw[1][k]) for k in raw[0]), \
        "two builds should draw different weights, or the test proves nothing"
    layers = tune._layers(args, config, ["s1", "s1", "s2"], cpu)
    assert list(layers) == ["s1", "s2"]
    assert [layer.plan.name for layer in layers.values()] == ["s1", "s2"]
    one, two = (layer.state_dict() for layer in layers.values())
    assert one.keys() == two.keys() and any("router" in k for k in one)
    assert all(same(one[k], two[k]) for k in one)


def test_init_std_and_vectors(one_rank_world):
    _, params = initialised(11, 3)
    scaled = STD / math.sqrt(2 * 2)
    checked_scaled = checked_plain = 0
    for name, param in params.items():
        if param.dim() < 2:
            # norm weights stay ones and biases zeros (megatron's constant init)
            expected = torch.ones_like(param) if name.endswith(".weight") else torch.zeros_like(param)
            assert torch.equal(param, expected), name
            continue
        std = param.detach().float().std().item()
        if param.numel() >= 1000:
            assert abs(param.detach().float().mean().item()) < 0.2 * STD, name
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert std == pytest.approx(scaled, rel=0.1), name
            checked_scaled += 1
        elif param.numel() >= 1000:
            assert std == pytest.approx(STD, rel=0.1), name
            checked_plain += 1
    # 2 layers: 2 attention projections + 2 x 4 expert fc2; fc1, qkv, embeddings
    assert checked_scaled == 2 + 2 * 4
    assert checked_plain >= 2 + 2 + 2 * 4
    assert any(p.dim() == 1 and n.endswith(".bias") for n, p in params.items())


def test_grouped_gemm_needs_what_grouped_mlp_needs():
    """megatron's GroupedMLP asserts bf16 and no biases when it runs; the flags say so first.
    (Without CUDA it runs on the CPU layer's grouped matmul; with CUDA it needs the
    grouped_gemm package, which tests/test_bad_input_inprocess.py cannot reach here.)"""
    base = ["--num-experts", "4", "--moe-grouped-gemm"]
    for flags, missing in (([], "--bf16"), (["--bf16"], "--disable-bias-linear")):
        with pytest.raises(ArgumentsError, match=f"GroupedMLP, which needs {missing}$"):
            parse_args(base + flags)
    args = parse_args(base + ["--bf16", "--disable-bias-linear"])
    assert args.moe_grouped_gemm and args.transformer_impl == "local"
    parse_args(["--moe-grouped-gemm"])  # no experts, nothing grouped: accepted


def test_init_is_deterministic_with_swiglu(one_rank_world):
    written, a = initialised(7, 1, "--swiglu")
    _, b = initialised(7, 2, "--swiglu")
    assert written >= sum(p.dim() >= 2 for p in a.values())  # SwiGLU fc1 is written in halves
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: same seed, different weights"


@pytest.mark.parametrize("activation", [(), ("--swiglu",)], ids=["gelu", "swiglu"])
def test_init_of_grouped_gemm_experts_is_sequential_mlps(one_rank_world, activation):
    """--moe-grouped-gemm (megatron's GroupedMLP: one weight1 [M, n H], one weight2 [n H, M])
    gets the very weights SequentialMLP gets, expert by expert, and everything else alike."""
    from parm_trainer.bench.weights import expert_matrices

    models = {}
    for extra in ((), ("--moe-grouped-gemm",)):
        args, model = build_tiny(1, "--bf16", *activation, *extra)
        init_weights_layout_free_for_test(model, args)
        models[bool(extra)] = model
    plain, grouped = models[False], models[True]
    for layer in range(2):
        a, b = (m.decoder.layers[layer].mlp.experts for m in (plain, grouped))
        assert (type(a).__name__, type(b).__name__) == ("SequentialMLP", "GroupedMLP")
        pairs = list(zip(expert_matrices(a), expert_matrices(b)))
        assert len(pairs) == 4
        for (fc1_a, fc2_a), (fc1_b, fc2_b) in pairs:
            assert torch.equal(fc1_a, fc1_b) and torch.equal(fc2_a, fc2_b)
            assert fc1_a.float().std() > STD / 2  # drawn, not megatron's or zeros
    rest = {k: v for k, v in grouped.named_parameters() if ".experts." not in k}
    for name, param in plain.named_parameters():
        if ".experts." not in name:
            assert torch.equal(param, rest.pop(name)), name
    assert not rest


def init_weights_layout_free_for_test(model, args):
    from parm_trainer.models.init import init_weights_layout_free

    return init_weights_layout_free(model, 7, STD, args.num_layers)


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


@pytest.mark.parametrize("pre_softmax", [False, True], ids=["top_k_softmax", "pre_softmax"])
def test_reference_routing_matches_megatron_core(pre_softmax):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from parm_trainer.moe.reference import route

    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    for k in (1, 2, 3):
        if k == 1 and not pre_softmax:
            continue  # megatron-core (and validate_layout) refuse top-1 without pre-softmax
        probs, routing_map = route(logits, k, pre_softmax)
        want_probs, want_map = topk_routing_with_score_function(
            logits, k, use_pre_softmax=pre_softmax, score_function="softmax")
        assert torch.equal(routing_map, want_map)
        assert torch.allclose(probs, want_probs, atol=1e-7, rtol=0)
        # pre-softmax keeps the full-softmax probabilities: they sum to less than 1
        assert (probs.sum(dim=1) < 1 - 1e-3).all() == pre_softmax


def test_progress_lines_and_bar():
    """The long tools' progress: plain lines off a terminal, one redrawn bar on one."""
    import io

    from parm_trainer.progress import Progress

    plain = io.StringIO()
    progress = Progress(3, "sweep", stream=plain)
    for name in ("a", "b", "c"):
        progress.done(name)
    lines = plain.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["sweep 1/3: a", "sweep 2/3: b",
                                                        "sweep 3/3: c"]
    assert all(" elapsed, ETA " in line for line in lines) and lines[-1].endswith("ETA 0:00")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    progress = Progress(2, "rounds", stream=tty)
    progress.done("first")
    assert tty.getvalue().startswith("\r\033[K[" + "#" * 12 + "." * 12 + "] rounds 1/2: first")
    assert "\n" not in tty.getvalue()
    progress.done("second")
    assert tty.getvalue().endswith("\n") and "[" + "#" * 24 + "] rounds 2/2: second" in tty.getvalue()
    silent = io.StringIO()
    Progress(1, "x", stream=silent, enabled=False).done("y")
    assert silent.getvalue() == ""


def test_plot_run_refuses_a_folder_without_a_run(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    for folder, says in ((tmp_path / "missing", "no tensorboard folder"),
                         (tmp_path, "no tensorboard event files")):
        if folder == tmp_path:
            (tmp_path / "tensorboard").mkdir()
        result = subprocess.run([sys.executable, "tools/plot_run.py", str(folder)], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 1 and result.stdout == ""
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: ") and says in line, line


def test_timing_report_formats():
    """--timing-log-option all|max|minmax on one report; MoE steps in plan order (s1 + SP)."""
    from parm_trainer.training.timers import format_report, max_over_ranks

    report = {"forward-backward": [10.0, 12.0], "optimizer": [0.0, 3.0],
              "moe/layer2/pipeline-fwd": [4.0, 5.0], "moe/layer2/pipeline-fwd-wait": [1.0, 2.0],
              "moe/layer2/gate-fwd": [1.0, 0.5], "moe/layer2/gate-bwd": [0.25, 0.75],
              "moe/layer2/combine-fwd": [0.5, 0.5], "moe/layer2/dispatch-fwd": [0.1, 0.2]}
    assert max_over_ranks(report)["forward-backward"] == 12.0
    every = format_report(report, "all").splitlines()
    assert every[:4] == ["times across ranks (ms):", "  forward-backward:", "     rank  0: 10.00",
                         "     rank  1: 12.00"]
    assert every[4:6] == ["  optimizer:", "     rank  1: 3.00"]  # rank 0 never ran it
    both = format_report(report, "minmax").splitlines()
    assert both[0] == "(min, max) time across ranks (ms):"
    assert both[1] == "    forward-backward ...............................: (10.00, 12.00)"
    assert both[2].endswith(": (3.00, 3.00)")
    assert both[3] == ("    moe layer 2 fwd/bwd (ms, max over ranks): gate 1.00/0.75 | "
                       "dispatch 0.20/0.00 | pipeline 5.00/0.00 (wait 2.00/0.00) | "
                       "combine 0.50/0.00 | total 6.70/0.75")
    assert format_report(report, "max").splitlines()[1].endswith(": 12.00")
    assert format_report({}, "max") == ""


# --- start-up: megatron-core's fused kernels stay eager without CUDA -----------------------------


def test_megatron_imports_without_torch_compile_on_cpu():
    """lazy_imports.eager_fusions_without_cuda: megatron-core imported without torch._dynamo or
    torch._inductor, torch.compile itself given back, and megatron's jit-fused functions the
    plain Python functions (the same arithmetic as megatron's unfused formula)."""
    code = """
import sys, torch
compile_ = torch.compile
from parm_trainer.lazy_imports import eager_fusions_without_cuda
eager_fusions_without_cuda()
from megatron.core.fusions.fused_bias_gelu import bias_gelu
x, b = torch.randn(64), torch.randn(64)
y = x + b
want = y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules),
      torch.compile is compile_, type(bias_gelu).__name__, torch.equal(bias_gelu(b, x), want))
"""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[]", "True", "function", "True"]


# --- the training loop's own collectives: on the device NCCL takes ----------------------------


def test_loop_collectives_take_tensors_on_the_rank_device(monkeypatch):
    """NCCL takes device tensors only: the loss reduction and the memory probe build their
    tensors where parallel.rank_device() says (the rank's GPU under CUDA). Here it is
    made to say "meta" and every all-reduce must receive a meta tensor; reading the meta result
    back afterwards raises, which the test expects."""
    from megatron.core import parallel_state

    from parm_trainer.training import loop, memory_probe

    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device.type))
    monkeypatch.setattr(parallel_state, "is_pipeline_last_stage", lambda: True)
    monkeypatch.setattr(parallel_state, "get_data_parallel_group", lambda: None)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_group", lambda: None)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)
    for module in (loop, memory_probe):
        monkeypatch.setattr(module, "rank_device", lambda: torch.device("meta"))
    with pytest.raises(NotImplementedError):  # .cpu() of the meta result
        loop._reduce_losses([{"lm loss": torch.tensor([6.0, 3.0])}], ("lm loss",))
    assert seen == ["meta", "meta"]  # data parallel, then pipeline
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError):
        memory_probe.report(argparse.Namespace(), [model], optimizer, 1024)
    assert seen == ["meta"] * 3
