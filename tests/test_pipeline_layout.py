"""Pipeline stages in one process: the placement the flags give is megatron-core's, and the
start-up log, the checkpoints' record and --pipeline-model-parallel-layout auto say it.

The launches that train under these layouts are in tests/test_training_layouts.py; the refusals
of each entry point in tests/test_bad_input_inprocess.py.
"""

import warnings

import pytest
import torch

from parm_trainer.planning import layout as pipeline_layout
from parm_trainer.planning import stages
from parm_trainer.arguments import ArgumentsError, parse_args
from parm_trainer.layer_pattern import moe_layer_freq
from parm_trainer.errors import LayoutError
from parm_trainer.planning.checks import validate_layout

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core: optional GPU extensions missing
    from megatron.core.transformer.pipeline_parallel_layer_layout import \
        PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset


def placed(world, *argv):
    args = parse_args(["--num-experts", "4", "--disable-bias-linear", *argv], world_size=world)
    validate_layout(args)
    return args


# (num layers, PP, first, last, V): megatron's own rule must place each layer where we say
UNEVEN = [(7, 2, 3, None, None), (7, 2, None, 2, None), (7, 4, 1, 2, None), (8, 4, 1, 1, None),
          (8, 2, None, None, 2), (12, 3, None, None, 2), (10, 3, 2, 4, 2), (12, 4, 2, 2, 2),
          (9, 3, None, None, 3), (7, 3, 1, None, None)]


@pytest.mark.parametrize("layers,pp,first,last,virtual", UNEVEN)
def test_placement_is_megatrons(layers, pp, first, last, virtual):
    argv = ["--num-layers", layers, "--pipeline-model-parallel-size", pp,
            "--global-batch-size", 2 * pp * 2]
    for flag, value in ((pipeline_layout.FIRST, first), (pipeline_layout.LAST, last),
                        (pipeline_layout.VIRTUAL, virtual)):
        argv += [flag, value] if value is not None else []
    args = placed(pp, *map(str, argv))
    config = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               num_layers_in_first_pipeline_stage=first,
                               num_layers_in_last_pipeline_stage=last,
                               virtual_pipeline_model_parallel_size=virtual)
    chunks = pipeline_layout.chunks_of(args.pipeline_stages, pp)
    assert len(chunks) == pp * (virtual or 1)
    assert sorted(i for c in chunks for i in c.layers) == list(range(layers))
    for chunk in chunks:
        vp_stage = chunk.virtual if virtual else None
        built = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=chunk.rank)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=chunk.rank)
        assert chunk.layers == tuple(range(offset, offset + built)), chunk


@pytest.mark.parametrize("layout,pp", [("Et|(tt|)*2,ttL", 4), ("E|t*3|tttL", 3),
                                       ("Ett|tt|tt|tL", 2), ("Et|tt|tL", 3)])
def test_layout_string_is_megatrons(layout, pp):
    layers = layout.replace("(tt|)*2,", "tt|tt|").replace("t*3", "ttt").count("t")
    args = placed(pp, "--num-layers", str(layers), "--pipeline-model-parallel-size", str(pp),
                  "--pipeline-model-parallel-layout", layout, "--global-batch-size", str(4 * pp))
    theirs = PipelineParallelLayerLayout(layout, pp)
    virtual = theirs.virtual_pipeline_model_parallel_size
    assert args.virtual_pipeline_model_parallel_size == (virtual if virtual > 1 else None)
    # megatron numbers the layers chunk after chunk in this order (get_layer_offset)
    letters = {"embedding": "E", "decoder": "t", "loss": "L"}
    order = [theirs.layout[i % pp][i // pp] for i in range(pp * virtual)]
    assert args.pipeline_stages == "|".join("".join(letters[kind.name] for kind in stage)
                                            for stage in order)


def test_start_up_lines_name_every_stage():
    args = placed(4, "--num-layers", "7", "--moe-layer-freq", "2",
                  "--pipeline-model-parallel-size", "4",
                  "--pipeline-model-parallel-layout", "Et|(tt|)*2,ttL")
    assert pipeline_layout.describe(args) == [
        "pipeline layout Et|tt|tt|ttL (4 stages)",
        "  PP rank 0: embedding, layer 1 (MoE)",
        "  PP rank 1: layers 2-3 (dense, MoE)",
        "  PP rank 2: layers 4-5 (dense, MoE)",
        "  PP rank 3: layers 6-7 (dense, MoE), loss"]
    args = placed(2, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                  "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8")
    assert pipeline_layout.describe(args) == [
        "pipeline layout Et|t|t|tL (2 stages x 2 virtual stages per rank, interleaved 1F1B)",
        "  PP rank 0, virtual stage 0: embedding, layer 1 (MoE)",
        "  PP rank 0, virtual stage 1: layer 3 (MoE)",
        "  PP rank 1, virtual stage 0: layer 2 (MoE)",
        "  PP rank 1, virtual stage 1: layer 4 (MoE), loss"]


def test_checkpoints_record_only_a_placement_other_than_the_even_split():
    even = placed(2, "--num-layers", "4", "--pipeline-model-parallel-size", "2")
    same = placed(2, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                  "--pipeline-model-parallel-layout", "Ett|ttL")
    uneven = placed(2, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                    "--decoder-first-pipeline-num-layers", "1")
    assert pipeline_layout.recorded_stages(even) is None
    assert pipeline_layout.recorded_stages(same) is None
    assert pipeline_layout.recorded_stages(uneven) == "Et|tttL"
    assert pipeline_layout.recorded_stages(placed(1)) is None


@pytest.mark.parametrize("text,pattern", [
    ("3", 3), ("([0]+[1]*7)", [0] + [1] * 7), ("[1,0,1,0]", [1, 0, 1, 0]),
    ("([1]*3+[0]*2)*2", [1, 1, 1, 0, 0] * 2), ("[1, 0]", [1, 0])])
def test_moe_layer_freq_takes_megatrons_forms(text, pattern):
    assert moe_layer_freq(text) == pattern


@pytest.mark.parametrize("text", ["[1,2]", "[1]*10**9", "__import__('os')", "[1]+1", "x"])
def test_moe_layer_freq_refuses_anything_else(text):
    with pytest.raises(Exception, match="--moe-layer-freq|is not a list|neither a number"):
        moe_layer_freq(text)


def test_auto_asks_the_stage_builder_and_checks_its_answer(monkeypatch):
    asked = []

    def auto_layout(args, log):
        asked.append(args.num_virtual_stages_per_pipeline_rank)
        log("chosen")
        return "Ettt|tL"

    monkeypatch.setattr(stages, "auto_layout", auto_layout)
    args = placed(2, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                  "--pipeline-model-parallel-layout", "auto")
    assert args.pipeline_stages is None
    lines = []
    pipeline_layout.resolve_auto(args, lines.append)
    assert asked == [None] and lines == ["chosen"]
    assert args.pipeline_model_parallel_layout == args.pipeline_stages == "Ettt|tL"
    # a string that does not fit the model is refused, naming where it came from
    args = placed(2, "--num-layers", "5", "--pipeline-model-parallel-size", "2",
                  "--pipeline-model-parallel-layout", "auto")
    with pytest.raises(LayoutError, match=r"auto chose 'Ettt\|tL', which does not fit: .* has 4 "
                                          r"decoder layers"):
        pipeline_layout.resolve_auto(args, lines.append)
    # V asked for and V given back must agree
    args = placed(2, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                  "--pipeline-model-parallel-layout", "auto",
                  "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8")
    with pytest.raises(LayoutError, match="with 1 virtual stages per rank; "
                                          "--num-virtual-stages-per-pipeline-rank asked for 2"):
        pipeline_layout.resolve_auto(args, lines.append)


@pytest.mark.parametrize("world,argv,fragment", [
    (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
         "--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication",
         "--global-batch-size", "8"],
     "--num-virtual-stages-per-pipeline-rank with --no-overlap-p2p-communication needs "
     "--pipeline-model-parallel-size > 2"),
    (1, ["--num-layers", "4", "--pipeline-model-parallel-layout", "Ett|ttL"],
     "--pipeline-model-parallel-layout: 2 virtual stages per rank (interleaving) need "
     "--pipeline-model-parallel-size > 1"),
    (1, ["--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2"],
     "virtual stages per rank (interleaving) need --pipeline-model-parallel-size > 1"),
    (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
         "--pipeline-model-parallel-layout", "Ett|ttL", "--num-virtual-stages-per-pipeline-rank",
         "1"],
     "--pipeline-model-parallel-layout and --num-virtual-stages-per-pipeline-rank exclude each "
     "other"),
    (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "1", "--decoder-first-pipeline-num-layers",
         "2"],
     "--num-layers-per-virtual-pipeline-stage cannot be used with uneven first or last stages"),
    (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
         "--decoder-last-pipeline-num-layers", "0"],
     "--decoder-last-pipeline-num-layers must be at least 1, got 0"),
    (4, ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
         "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1",
         "--num-virtual-stages-per-pipeline-rank", "2"],
     "--num-virtual-stages-per-pipeline-rank 2 does not divide "
     "--decoder-first-pipeline-num-layers (1, layers per stage on rank 0)"),
], ids=["no_overlap_pp2", "layout_pp1", "virtual_pp1", "layout_with_virtual",
        "layers_per_virtual_uneven", "last_zero", "virtual_vs_first"])
def test_interleaving_rules(world, argv, fragment):
    with pytest.raises((LayoutError, ArgumentsError)) as error:  # a range: parse_args's
        placed(world, *argv)
    assert fragment in str(error.value), str(error.value)


def test_layers_per_virtual_stage_gives_v():
    args = placed(2, "--num-layers", "8", "--pipeline-model-parallel-size", "2",
                  "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "8")
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.pipeline_stages == "Ett|tt|tt|ttL"


def test_another_placement_is_another_layout_for_a_checkpoint(monkeypatch):
    """The stages are part of the layout a checkpoint records: under another placement the RNG
    streams start afresh and megatron's dp_reshardable optimizer state is refused."""
    from parm_trainer.training.checkpoint import load
    from parm_trainer.training.checkpoint.files import CheckpointError

    sizes = {"tp": 1, "pp": 2, "dp": 1, "ep": 1, "esp": 1, "world": 2}
    monkeypatch.setattr(load, "layout", lambda: {**sizes, "stages": "Ettt|ttttL"})
    monkeypatch.setattr(load, "is_distributed", lambda optimizer: True)
    saved = {"layout": {**sizes, "stages": "Ett|tt|tt|tL"}, "distributed_optimizer": True}
    monkeypatch.setattr(load, "_content_metadata",
                        lambda common: {"distrib_optim_sharding_type": "fully_reshardable"})
    load_optimizer, with_rng, notes = load.what_to_load(saved, "ckpt", None, True, True)
    assert load_optimizer and not with_rng
    assert notes == ["RNG streams not restored: the checkpoint was saved under TP1 PP2 DP1 EP1 "
                     "ESP1 stages Ett|tt|tt|tL, this run is TP1 PP2 DP1 EP1 ESP1 stages "
                     "Ettt|ttttL; dropout streams start afresh from --seed"]
    monkeypatch.setattr(load, "_content_metadata",
                        lambda common: {"distrib_optim_sharding_type": "dp_reshardable"})
    with pytest.raises(CheckpointError, match="dp_reshardable format under TP1 PP2 DP1 EP1 ESP1 "
                                              r"stages Ett\|tt\|tt\|tL, which loads only"):
        load.what_to_load(saved, "ckpt", None, True, True)
    # the even split records nothing: a checkpoint from before stages were recorded matches
    monkeypatch.setattr(load, "layout", lambda: dict(sizes))
    assert load.what_to_load({"layout": sizes, "distributed_optimizer": True}, "ckpt",
                              None, True, True)[:2] == (True, True)
