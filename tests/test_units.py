"""python -m pytest tests/test_units.py -q

Fast single-process unit tests (no torchrun) of what has no file of its own: the FLOPs formula,
the pretraining sampler's order, the reference routing, progress lines, the run plots' input,
the timing report, megatron-core's imports on CPU and the loop's collectives. Layout checks:
test_planning_checks.py; flags: test_arguments.py; the models' init: test_models_init.py.
"""

import argparse
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parm_trainer.arguments import parse_args
from parm_trainer.planning.checks import validate_layout

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core: optional GPU extensions missing
    from parm_trainer.training.data import PretrainingSampler
    from parm_trainer.training.flops import flops_per_iteration

REPO = Path(__file__).resolve().parents[1]



def layout(world, *argv):
    args = parse_args(list(argv), world_size=world)
    validate_layout(args)
    return args



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
    from conftest import python

    for folder, says in ((tmp_path / "missing", "no tensorboard folder"),
                         (tmp_path, "no tensorboard event files")):
        if folder == tmp_path:
            (tmp_path / "tensorboard").mkdir()
        result = python("tools/plot_run.py", folder, timeout=120)
        assert result.returncode == 1 and result.stdout == ""
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: ") and says in line, line


def test_timing_report_formats():
    """--timing-log-option all|max|minmax on one report; MoE steps in plan order (s1 + SP)."""
    from parm_trainer.training.timers import format_report, max_over_ranks

    report = {"forward-backward": [10.0, 12.0], "optimizer": [0.0, 3.0],
              "moe/layer2/exchange-fwd": [4.0, 5.0], "moe/layer2/exchange-fwd-wait": [1.0, 2.0],
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
                       "dispatch 0.20/0.00 | exchange 5.00/0.00 (wait 2.00/0.00) | "
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
