"""The models in one process (parm_trainer/models/): the vocabulary's padding, and the
layout-free weight initialisation on a tiny megatron GPTModel in a one-rank gloo world."""

import math
import warnings

import pytest
import torch

from parm_trainer.arguments import ArgumentsError, parse_args
from parm_trainer.planning.checks import validate_layout

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core: optional GPU extensions missing
    from parm_trainer.models.config import padded_vocab_size



def layout(world, *argv):
    args = parse_args(list(argv), world_size=world)
    validate_layout(args)
    return args



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


# --- init_weights_layout_free on a tiny megatron GPTModel ---------------------------------------------

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-experts", "4", "--moe-ffn-hidden-size", "512", "--seq-length", "64",
        "--disable-bias-linear", "--moe-parm-schedule", "s1", "--moe-parm-chunks", "1"]
VOCAB = 1024
STD = 0.02


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
    from parm_trainer.schedule import tune

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
