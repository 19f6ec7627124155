"""The stage builder's default path: the model's pieces measured on this machine
(parm_trainer/schedule/layer_times.py), cached, and priced in place of the profile's compute
(parm_trainer/planning/measured_cost.py); a profile given still wins.

In one process on a one-rank world; the launch that settles a run's stages this way is
tests/test_training_layouts.py's pp2 case.
"""

import pytest

from conftest import load_module

from parm_trainer.arguments import parse_args
from parm_trainer.moe.cost_profile import DEFAULT_PROFILE, Profile, profile_source
from parm_trainer.planning.model_cost import ModelCost
from parm_trainer.planning.stages import auto_layout, even_split, layout_string, split
from parm_trainer.schedule import layer_times

# tools/bench_pipeline.py's head-heavy model: the output layer of a 32000-entry vocabulary at
# hidden 128 does about 15 times a decoder layer's GEMM work
HEAD_HEAVY = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4",
              "--seq-length", "256", "--max-position-embeddings", "256",
              "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
              "--moe-ffn-hidden-size", "256", "--moe-layer-freq", "2", "--micro-batch-size",
              "2", "--global-batch-size", "16", "--moe-parm-schedule", "s1",
              "--moe-parm-chunks", "1"]


def _model(tmp_path, *extra, world=1):
    args = parse_args([*HEAD_HEAVY, "--moe-parm-tune-cache", str(tmp_path / "tune.json"),
                       *extra], world_size=world)
    args.padded_vocab_size = 32000
    return args


@pytest.fixture
def as_a_rank():
    """As a rank of the entry points computes on CPU: megatron's fused functions eager, not
    compiled (lazy_imports.eager_fusions_without_cuda; megatron-core was imported here
    before), on one thread (torchrun's default)."""
    import torch
    import torch._dynamo

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch._dynamo.config.patch(disable=True):
        yield
    torch.set_num_threads(threads)


def test_measured_pieces_take_layers_off_the_heads_stage(one_rank_world, as_a_rank, tmp_path,
                                                         monkeypatch):
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    args = _model(tmp_path)
    cache = tmp_path / "tune.json"
    said = []
    tracker = get_moe_layer_wise_logging_tracker()
    opened = set(tracker)
    times = layer_times.measured_layer_times(args, said.append)
    # megatron's aux-loss tracker keeps no entry sized for the 2-layer model measured (the
    # run's 8 layers would overrun it)
    assert set(tracker) == opened
    seconds = {kind: sum(pair) for kind, pair in times["seconds"].items()}
    assert list(seconds) == ["E", "t", "m", "L"]
    assert seconds["L"] > 3 * max(seconds["t"], seconds["m"]) > 3 * seconds["E"] > 0, seconds
    assert said[0].startswith("layer times for the stage builder") and \
        "(measured now in " in said[0] and f", cached in {cache})" in said[0], said
    # at PP2 (the layout measured: TP = EP = 1) the pieces cost what was measured, and the
    # split leaves the output layer with fewer decoder layers than megatron's even split
    pp2 = _model(tmp_path, "--pipeline-model-parallel-size", "2",
                 "--pipeline-model-parallel-layout", "auto", world=2)
    pp2.layer_times = times
    cost = ModelCost(pp2, DEFAULT_PROFILE)
    pieces = cost.pieces()
    assert [p.total_s for p in pieces] == pytest.approx([seconds[p.kind] for p in pieces])
    runs = split(pieces, 2, cost)
    assert len(runs[-1]) < len(even_split(pieces, 2)[-1]), layout_string(runs)
    logged = []
    assert auto_layout(pp2, log=logged.append) == layout_string(runs)
    assert "(predicted with layer times measured now in" in logged[0] and \
        "communication from the built-in default profile" in logged[0], logged
    # the same model on the same machine again: read from the cache, nothing measured
    monkeypatch.setattr(layer_times, "measure", lambda args: pytest.fail("measured again"))
    again = layer_times.measured_layer_times(args, said.append)
    assert again["seconds"] == times["seconds"] and said[-1].endswith(f"(cached in {cache})")
    assert again["source"] == f"layer times cached in {cache}"
    # another shape is another entry
    other = _model(tmp_path, "--seq-length", "128")
    monkeypatch.setattr(layer_times, "measure", lambda args: {"E": [1.0, 1.0]})
    assert layer_times.measured_layer_times(other, said.append)["seconds"] == {"E": [1.0, 1.0]}


def _fake_times(args, **seconds):
    return {"seconds": seconds, "layout": layer_times.layout_of(args),
            "source": "layer times measured now in 1.0 s"}


def test_a_profile_given_still_wins(tmp_path):
    args = _model(tmp_path, "--pipeline-model-parallel-size", "2",
                  "--pipeline-model-parallel-layout", "auto", world=2)
    plain = [(p.forward_s, p.backward_s) for p in ModelCost(args, DEFAULT_PROFILE).pieces()]
    assert layer_times.wanted(args)
    args.layer_times = _fake_times(args, E=[1.0, 2.0], t=[3.0, 4.0], m=[5.0, 6.0],
                                   L=[30.0, 40.0])
    measured = [(p.forward_s, p.backward_s) for p in ModelCost(args, DEFAULT_PROFILE).pieces()]
    assert measured == [(1.0, 2.0), *[(5.0, 6.0), (3.0, 4.0)] * 4, (30.0, 40.0)]
    assert auto_layout(args, log=lambda line: None) == "Etttttttt|L"
    assert profile_source(args, DEFAULT_PROFILE).startswith(
        "layer times measured now in 1.0 s, communication from the built-in default profile")
    path = tmp_path / "profile.json"
    DEFAULT_PROFILE.to_json(str(path))
    args.moe_parm_cost_profile = str(path)
    assert not layer_times.wanted(args)
    given = [(p.forward_s, p.backward_s) for p in ModelCost(args, DEFAULT_PROFILE).pieces()]
    assert given == plain and profile_source(args, DEFAULT_PROFILE) == str(path)


def test_measured_under_one_layout_scaled_to_another(tmp_path):
    """Measured at TP 1 (tools/plan_layout.py), a TP 2 layout's dense layer computes half the
    GEMM work (every projection, the core attention and the MLP split over TP) and adds the
    profile's all-reduce after its attention and its MLP; the embedding's lookup, which the
    profile prices at nothing without a memory rate, keeps its measured seconds."""
    one = _model(tmp_path)
    tp2 = _model(tmp_path, "--tensor-model-parallel-size", "2", world=2)
    tp2.num_experts = None  # every decoder layer dense
    tp2.layer_times = _fake_times(one, E=[0.5, 0.7], t=[3.0, 4.0], L=[30.0, 40.0])
    flops_only = Profile(gpus_per_node=8, compute=(0.0, 1e-12),
                         collectives=DEFAULT_PROFILE.collectives)
    cost = ModelCost(tp2, flops_only)
    e, t = cost.pieces()[:2]
    reduce = cost.coll("allreduce", cost.n * 128 * 4, 2)
    assert (e.forward_s, e.backward_s) == pytest.approx((0.5 + reduce, 0.7 + reduce))
    assert (t.forward_s, t.backward_s) == pytest.approx((1.5 + 2 * reduce, 2.0 + 2 * reduce))


def test_plan_layout_measures_on_its_default_path(as_a_rank, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PARM_TRAINER_CACHE_DIR", str(tmp_path))
    plan_layout = load_module("tools/plan_layout.py", "plan_layout")
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "64", "--num-experts", "4", "--moe-layer-freq", "2",
             "--micro-batch-size", "2", "--global-batch-size", "8"]
    argv = ["--nodes", "1", "--gpus-per-node", "2", "--top", "3", "--", *model]
    for source in ("measured now in", "cached in"):
        assert plan_layout.main(argv) == 0
        out = capsys.readouterr().out
        assert f"priced with layer times {source}" in out and "(one rank)" in out, out
    assert plan_layout.main(["--no-measure", *argv]) == 0
    assert "priced with the built-in default profile" in capsys.readouterr().out
    assert plan_layout.main(["--flags-only", *argv]) == 0  # a launcher's line alone
    assert capsys.readouterr().out.startswith("--tensor-model-parallel-size")


def test_measured_pieces_keep_selective_recomputes_time(tmp_path):
    """The pieces are measured without recomputation (one measurement prices every recompute
    setting the stage builder tries under --memory-gb); a selectively recomputed part's
    forward, priced by the profile, is added to the measured backward, scaled as the measured
    forward is to the profile's."""
    args = _model(tmp_path, "--pipeline-model-parallel-size", "2",
                  "--pipeline-model-parallel-layout", "auto", "--recompute-granularity",
                  "selective", "--recompute-modules", "core_attn", "moe", world=2)
    assert layer_times._trial(args, ["t", "m"]).recompute_granularity is None
    profile = {p.kind: p for p in ModelCost(args, DEFAULT_PROFILE).pieces()}
    assert profile["t"].recompute_s > 0 and profile["m"].recompute_s > profile["t"].recompute_s
    args.layer_times = _fake_times(args, E=[1.0, 2.0], t=[3.0, 4.0], m=[5.0, 6.0],
                                   L=[30.0, 40.0])
    measured = {p.kind: p for p in ModelCost(args, DEFAULT_PROFILE).pieces()}
    for kind, (forward, backward) in (("t", (3.0, 4.0)), ("m", (5.0, 6.0))):
        again = profile[kind].recompute_s * forward / profile[kind].forward_s
        assert measured[kind].forward_s == forward
        assert measured[kind].backward_s == pytest.approx(backward + again)
    assert measured["L"].backward_s == 40.0 and measured["E"].backward_s == 2.0


def test_the_measured_output_piece_runs_the_mtp_layers(one_rank_world, as_a_rank, tmp_path,
                                                       monkeypatch):
    """The cost model folds the MTP layers into the output piece (model_cost.py): with
    --mtp-num-layers the measured "L" runs megatron-core's MTP block, forward and backward."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    calls = []
    forward = MultiTokenPredictionBlock.forward
    monkeypatch.setattr(MultiTokenPredictionBlock, "forward",
                        lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    args = _model(tmp_path, "--mtp-num-layers", "1", "--position-embedding-type", "rope",
                  "--untie-embeddings-and-output-weights")
    seconds = layer_times.measure(args)
    assert list(seconds) == ["E", "t", "m", "L"] and calls, calls
    assert len(calls) == layer_times.WARMUP + layer_times.ROUNDS, calls
