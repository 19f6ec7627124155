"""The whole-model cost model and the stage builder (parm_trainer/planning/).

The split is checked against every split (brute force), its layout string against
megatron-core's own parser, and the cost model's GEMM FLOPs against torch's FLOP counter on the
real megatron-core model."""

import itertools
import re
import random

import pytest
import torch

from conftest import load_module
from test_models_init import build_tiny

from parm_trainer.moe.cost_profile import DEFAULT_PROFILE, Profile
from parm_trainer.planning.model_cost import ModelCost, Piece, moe_layers
from parm_trainer.planning.stages import (NoSplitFits, auto_layout, even_split, in_flight,
                                          layout_string, live_micro_batches, predict, split)


def _pieces(times, kinds=None):
    kinds = kinds or ["E", *"t" * (len(times) - 2), "L"]
    return [Piece(k, t, 0.0, 1.0, 0.0, 1.0) for k, t in zip(kinds, times)]


class _Flat:
    """A ModelCost stand-in for split(): 8 bytes of state per parameter."""
    def state_bytes(self, params, expert_params=0.0):
        return 8 * params


@pytest.mark.parametrize("seed", range(6))
def test_split_is_the_best_of_every_split(seed):
    rng = random.Random(seed)
    n, stages = rng.randint(4, 9), rng.randint(2, 4)
    pieces = _pieces([rng.uniform(0.1, 5.0) for _ in range(n)])
    runs = split(pieces, stages, _Flat())
    assert [p for run in runs for p in run] == pieces and len(runs) == stages
    assert all(runs), "every stage holds at least one piece"
    best = min(max(sum(p.total_s for p in pieces[i:j]) for i, j in zip((0, *cuts), (*cuts, n)))
               for cuts in itertools.combinations(range(1, n), stages - 1))
    assert max(sum(p.total_s for p in run) for run in runs) == pytest.approx(best)


def test_split_respects_the_memory_limit_and_says_when_nothing_fits():
    pieces = _pieces([1.0] * 6)  # each piece: 1 parameter (8 bytes) + 1 activation byte
    runs = split(pieces, 2, _Flat(), in_flight=[2, 1], memory_limit_bytes=10 * 3 + 0.5)
    for run, flight in zip(runs, (2, 1)):
        assert 8 * len(run) + flight * len(run) <= 30.5
    with pytest.raises(NoSplitFits, match="memory limit"):
        split(pieces, 2, _Flat(), memory_limit_bytes=9 * 2)
    with pytest.raises(NoSplitFits, match="at most one stage per piece"):
        split(pieces, 7, _Flat())


@pytest.mark.parametrize("pp,vp,m", [(2, 1, 8), (4, 1, 3), (2, 2, 4), (4, 2, 8), (2, 3, 6)])
def test_micro_batches_in_flight_follow_megatrons_schedule(pp, vp, m):
    """1F1B: stage k holds min(m, P - k); interleaved: every forward of the schedule table is
    run once and released by the end, and rank 0 (the longest warm-up) holds the most. The
    peaks are measured in training by --memory-probe (test_training_layouts)."""
    if vp == 1:
        assert in_flight(pp, vp, m) == [min(m, pp - k) for k in range(pp)]
    peaks = []
    for rank in range(pp):
        snaps = live_micro_batches(pp, vp, m, rank)
        assert len(snaps) == m * vp and all(0 <= n <= m for snap in snaps for n in snap)
        peaks.append(max(sum(snap) for snap in snaps))
    assert peaks == sorted(peaks, reverse=True) and peaks[0] <= m * vp
    if vp > 1:  # megatron's warm-up: (P - 1) x 2 + (V - 1) x P forwards, then one more
        assert peaks[0] == min(m * vp, (pp - 1) * 2 + (vp - 1) * pp + 1)


def test_layout_strings_are_megatrons():
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout)

    pieces = _pieces([1, 9, 1, 1, 1, 1, 1, 1, 9])
    for stages, pp in ((2, 2), (4, 4), (4, 2)):
        text = layout_string(split(pieces, stages, _Flat()))
        layout = PipelineParallelLayerLayout(text, pp)
        layout.validate_layer_layout(num_layers=7, mtp_num_layers=None)
    assert layout_string(even_split(_pieces([1] * 6), 2)) == "Ett|ttL"


def _head_heavy(**overrides):
    from parm_trainer.arguments import parse_args

    argv = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "256", "--num-experts", "4", "--moe-layer-freq", "2",
            "--micro-batch-size", "2", "--global-batch-size", "16", "--swiglu",
            "--pipeline-model-parallel-size", "2", "--disable-bias-linear"]
    args = parse_args(argv, world_size=2)
    args.padded_vocab_size = 32000
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_a_heavy_head_moves_layers_to_the_first_stage():
    # on the default (A100) profile a 32000-entry head costs less than a layer's GEMM launches
    # at hidden 128; a 256000-entry one (a large multilingual vocabulary) outweighs them
    args = _head_heavy(padded_vocab_size=256000)
    cost = ModelCost(args, DEFAULT_PROFILE)
    pieces = cost.pieces()
    assert [p.kind for p in pieces[1:-1]] == ["m", "t"] * 4 == \
        ["m" if moe else "t" for moe in moe_layers(args)]
    runs = split(pieces, 2, cost)
    assert len(runs[0]) > len(even_split(pieces, 2)[0])
    auto = predict(runs, cost, 2, 1, 8)["iteration_s"]
    assert auto < predict(even_split(pieces, 2), cost, 2, 1, 8)["iteration_s"]
    lines = []
    assert auto_layout(args, log=lines.append) == layout_string(runs)
    assert "rank 1:" in lines[0] and "ms per iteration" in lines[0]


def _flop_profile():
    """Every GEMM priced at one second per FLOP, nothing else priced."""
    zero = {"intra": (0.0, 0.0), "inter": (0.0, 0.0)}
    return Profile(gpus_per_node=1, compute=(0.0, 1.0),
                   collectives={k: dict(zero) for k in ("alltoall", "allgather",
                                                        "reducescatter", "allreduce")})


NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.parametrize("extra", [
    [], ["--swiglu"], ["--moe-layer-freq", "2", *NO_DROPOUT],
    [*NO_DROPOUT, "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
     "--moe-router-topk", "3"],
    [*NO_DROPOUT, "--position-embedding-type", "rope", "--mtp-num-layers", "2"],
    [*NO_DROPOUT, "--position-embedding-type", "rope", "--mtp-num-layers", "1", "--swiglu",
     "--moe-layer-freq", "[1,0]", "--normalization", "RMSNorm"],
    [*NO_DROPOUT, "--position-embedding-type", "rope", "--multi-latent-attention",
     "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "12",
     "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--normalization", "RMSNorm"],
    [*NO_DROPOUT, "--position-embedding-type", "rope", "--multi-latent-attention",
     "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
     "--v-head-dim", "12", "--qk-layernorm", "--normalization", "RMSNorm", "--swiglu"]])
def test_flops_and_activations_match_the_real_model(one_rank_world, extra):  # noqa: F811
    """Forward GEMM FLOPs against torch's FLOP counter, and the bytes autograd keeps for the
    backward (unique storages that are not parameters) against saved_tensors_hooks, on one
    forward of megatron-core's model as the project builds it."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.core.transformer.moe import moe_utils

    moe_utils.get_moe_layer_wise_logging_tracker().clear()  # sized by the MoE and MTP layers
    args, model = build_tiny(1, "--micro-batch-size", "2", *extra)
    args.padded_vocab_size = 1024
    tokens = torch.randint(0, 1024, (2, args.seq_length))
    position = torch.arange(args.seq_length).expand(2, -1)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with FlopCounterMode(display=False) as counter, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens, position, None, labels=tokens)
    cost = ModelCost(args, _flop_profile(), moe_schedule=("s1", 1))
    pieces = cost.pieces()
    predicted = sum(p.forward_s for p in pieces)
    assert predicted == pytest.approx(counter.get_total_flops(), rel=0.02)
    activations = sum(p.activation_bytes for p in pieces)
    assert activations == pytest.approx(sum(saved.values()), rel=0.05)


PLAN_MODEL = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "128", "--num-experts", "4", "--moe-layer-freq", "2",
              "--micro-batch-size", "2", "--global-batch-size", "16"]


def test_plan_layout_ranks_layouts_that_run(capsys):
    from parm_trainer.arguments import parse_args
    from parm_trainer.planning.checks import validate_layout
    from parm_trainer.planning.search import candidates

    plan_layout = load_module("tools/plan_layout.py", "plan_layout")
    assert plan_layout.main(["--nodes", "2", "--gpus-per-node", "2", "--top", "5",
                             "--", *PLAN_MODEL]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^ +\d+ +\d+ ", line)]
    assert len(rows) == 5 and out.splitlines()[-1].startswith("best: --tensor-model-parallel-size")
    model = parse_args(PLAN_MODEL, world_size=1)
    ranked = candidates(model, DEFAULT_PROFILE, 2, 2, 32000)
    times = [c.iteration_s for c in ranked]
    assert times == sorted(times) and len({(c.tp, c.ep, c.esp, c.pp, c.vp) for c in ranked}) \
        == len(ranked) > 10
    for c in ranked:  # every layout's flags, as given to a run, pass the project's checks
        trial = parse_args([*PLAN_MODEL, *c.flags()], world_size=4)
        validate_layout(trial)
        assert (trial.virtual_pipeline_model_parallel_size or 1) == c.vp
        assert c.layout.count("t") == 6 and c.layout.count("|") == c.pp * c.vp - 1
    # under a memory limit, a layout over it without recomputation takes a recompute setting
    # (recompute_choice.py; test_recompute_choice.py) whose flags run; one nothing meets is
    # refused in one line
    limit = sorted(c.memory_bytes for c in ranked)[len(ranked) // 2]
    kept = candidates(model, DEFAULT_PROFILE, 2, 2, 32000, memory_limit_bytes=limit)
    assert kept and all(c.memory_bytes <= limit for c in kept)
    plain = {(c.tp, c.ep, c.esp, c.pp, c.vp): c for c in ranked}
    assert not any(c.recompute for c in ranked)
    for c in kept:
        before = plain[c.tp, c.ep, c.esp, c.pp, c.vp]
        assert c.recompute or before.memory_bytes <= limit
        assert not c.recompute or c.iteration_s > before.iteration_s  # it costs time
        if c.recompute:
            trial = parse_args([*PLAN_MODEL, *c.flags()], world_size=4)
            validate_layout(trial)
            assert trial.recompute_granularity == c.recompute[1]
    assert any(c.recompute for c in kept) and any(not c.recompute for c in kept)
    assert plan_layout.main(["--nodes", "2", "--gpus-per-node", "2", "--memory-gb", "0.0001",
                             "--", *PLAN_MODEL]) == 1
    assert "error: no layout runs this model on 2 x 2 ranks within --memory-gb" in \
        capsys.readouterr().err


def test_train_script_launches_with_the_planners_choice(tmp_path, gpt_data):
    """LAYOUT=auto in scripts/train_gpt_moe.sh: the launch carries plan_layout's best flags
    (the interpreter is a stand-in that runs the planner and prints the launch)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\nif [ "$1" = tools/plan_layout.py ]; then exec {sys.executable} '
                      '"$@"; fi\necho "LAUNCH $*"\n')
    python.chmod(0o755)
    env = {**os.environ, "LAYOUT": "auto", "PYTHON": str(python), "NPROC_PER_NODE": "4",
           "TOKENIZER_MODEL": gpt_data["tokenizer"], "DATA_PATH": gpt_data["prefix"],
           "RUN_DIR": str(tmp_path / "run")}
    run = subprocess.run(["bash", "scripts/train_gpt_moe.sh", "--num-layers", "6"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    planned = run.stdout.splitlines()[0].removeprefix("LAYOUT=auto: ")
    launch = run.stdout.splitlines()[-1]
    assert planned.startswith("--tensor-model-parallel-size") and planned in launch, run.stdout
    expected = subprocess.run(
        [sys.executable, "tools/plan_layout.py", "--nodes", "1", "--gpus-per-node", "4",
         "--flags-only", "--", *launch.split("pretrain_gpt_moe.py ", 1)[1].split()],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert expected.stdout.strip() == planned, expected.stderr
