"""A Megatron-LM user's scripts run as written: the flags of Megatron-LM's own recipes.

The recipes' argument arrays are data (megatron_recipes.py, as published at core_v0.16.1);
the launches change only sizes, paths and the parallel sizes the rank count sets.
"""

import json
import re

import pytest

import megatron_recipes as recipes
from conftest import launch, tiny_gpt_args
from parm_trainer.arguments import ArgumentsError, build_parser, parse_args
from parm_trainer.arguments.megatron_only import ROWS
from parm_trainer.training import checkpoint_args


@pytest.mark.parametrize("recipe", [recipes.MIXTRAL_8X7B, recipes.GPT3_175B,
                                    recipes.MOE_README_MIXTRAL], ids=lambda r: r.source[-40:])
def test_every_recipe_flag_is_known(recipe):
    _, unknown = build_parser().parse_known_args(recipes.words(recipe))
    assert unknown == [], f"{recipe.source}: {unknown}"


def test_the_moe_readme_tips_are_known_and_the_unsupported_refused():
    _, unknown = build_parser().parse_known_args(recipes.MOE_README_TIPS)
    assert unknown == []
    with pytest.raises(ArgumentsError, match="is not supported here: "):
        parse_args(recipes.MOE_README_TIPS)


def _value(row, fine: bool) -> list:
    if row.takes == 0:
        return []
    return [row.fine[0]] if fine else ["2"]


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.flag)
def test_every_megatron_only_flag_is_refused_or_noted(row):
    """A flag with no effect is accepted and logged once; a refused one is one line naming it;
    a value that is this stack's own behaviour is accepted silently."""
    argv = [row.flag, *_value(row, fine=False)]
    if row.effect == "none":
        notes = parse_args(argv).start_notes
        assert notes == [f"{row.flag} has no effect here: {row.why}"]
    else:
        with pytest.raises(ArgumentsError) as refused:
            parse_args(argv)
        assert str(refused.value).startswith(f"{' '.join(argv)} is not supported here: ")
    if row.fine:
        assert parse_args([row.flag, *_value(row, fine=True)]).start_notes == []
    assert parse_args([]).start_notes == []  # nothing logged for a flag not given


def test_help_shows_each_default():
    shown = build_parser().format_help()
    for flag, default in (("--seq-length", "128"), ("--attention-backend", "auto"),
                          ("--manual-gc-interval", "0"), ("--lr", "0.0003")):
        block = shown[shown.index(f"  {flag} "):]
        assert f"(default: {default})" in block[:block.index("\n  --")].replace("\n", " "), flag
    for action in build_parser()._actions:  # each flag names its default, or says what it is
        if action.option_strings and action.help and action.default is not None \
                and action.dest != "help" and not isinstance(action.default, bool):
            assert "default" in action.help.lower() or action.default == "==SUPPRESS==" or \
                "(default: " in build_parser()._get_formatter()._get_help_string(action), \
                action.option_strings[0]


def test_sequence_parallel_is_off_without_tensor_parallelism():
    args = parse_args(["--sequence-parallel"])
    assert not args.sequence_parallel
    assert "--sequence-parallel is off" in args.start_notes[0]
    assert parse_args(["--sequence-parallel", "--tensor-model-parallel-size", "2"]
                      ).sequence_parallel


def test_use_checkpoint_args_takes_the_model_from_run_json(tmp_path):
    """Megatron-LM's rule: the sizes given on the command line win, the rest of the model's
    flags are the checkpoint's; the tokenizer comes from the checkpoint's copy."""
    saved = parse_args(["--num-layers", "3", "--hidden-size", "96", "--num-attention-heads",
                        "6", "--swiglu", "--normalization", "RMSNorm", "--num-experts", "8",
                        "--moe-router-topk", "4", "--disable-bias-linear"])
    iteration = tmp_path / "iter_0000007"
    iteration.mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    (iteration / "run.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(saved).items() if k != "params_dtype"}}))
    (iteration / "tokenizer.model").write_bytes(b"")
    args = parse_args(["--load", str(tmp_path), "--use-checkpoint-args", "--num-layers", "5",
                       "--moe-router-topk", "1", "--moe-router-pre-softmax"],
                      override=checkpoint_args.apply)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (5, 96, 6)
    assert args.swiglu and args.normalization == "RMSNorm" and args.num_experts == 8
    assert args.moe_router_topk == 4  # always the checkpoint's (Megatron-LM's force=True)
    assert args.tokenizer_model == str(iteration / "tokenizer.model")
    assert re.search(r"from .*: hidden_size 96, ffn_hidden_size 384, .*swiglu True",
                     args.start_notes[0]), args.start_notes
    without = parse_args(["--load", str(tmp_path), "--num-layers", "5"],
                         override=checkpoint_args.apply)
    assert without.hidden_size == 128 and without.start_notes == []


# ranks -> the layout that takes the recipe's place (TP, PP, EP as its GPU count set them)
MIXTRAL_LAYOUTS = {2: {"--pipeline-model-parallel-size": "1", "--expert-model-parallel-size": "2"},
                   4: {"--pipeline-model-parallel-size": "2", "--expert-model-parallel-size": "2"}}
MIXTRAL_SIZES = {
    "--seq-length": "64", "--max-position-embeddings": "256", "--num-layers": "4",
    "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
    "--num-query-groups": "2", "--global-batch-size": "8", "--train-iters": "4",
    "--lr-decay-iters": "4", "--lr-warmup-iters": "1", "--save-interval": "4",
    "--eval-interval": "2", "--eval-iters": "1", "--split": "90,5,5"}


@pytest.mark.parametrize("nproc", [2, 4])
def test_mixtral_recipe_trains(nproc, gpt_data, tmp_path):
    """examples/mixtral's arrays as published (bf16, grouped GEMM, the distributed optimizer
    with its overlapped gather, Llama2Tokenizer, --no-load-optim, ...) on 2 and 4 CPU ranks."""
    argv = recipes.argv(recipes.MIXTRAL_8X7B, {**MIXTRAL_SIZES, **MIXTRAL_LAYOUTS[nproc]},
                        {"TOKENIZER_MODEL": gpt_data["tokenizer"],
                         "DATA_PATH": gpt_data["prefix"], "CHECKPOINT_PATH": tmp_path / "ckpt"})
    run = launch(nproc, argv, tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    assert [row["iteration"] for row in run.losses] == [1, 2, 3, 4]
    assert all(0 < loss < 20 for loss in run.loss()), run.loss()
    for line in ("--use-mcore-models has no effect here", "--no-masked-softmax-fusion has no "
                 "effect here", "--sequence-parallel is off", "no checkpoint in --load",
                 "saved checkpoint"):
        assert line in run.output, line
    assert (tmp_path / "ckpt" / "iter_0000004").is_dir()
    assert list((tmp_path / "ckpt" / "tensorboard").iterdir())
    if nproc == 2:  # the model again from the checkpoint's flags alone (a strict load), on
        # mock data, saved without optimizer and RNG, throughput logged, the collector manual
        resumed = launch(2, ["--load", tmp_path / "ckpt", "--use-checkpoint-args", "--bf16",
                             "--use-distributed-optimizer", "--expert-model-parallel-size", "2",
                             "--mock-data", "--micro-batch-size", "1", "--global-batch-size",
                             "8", "--train-iters", "6", "--eval-iters", "0", "--save",
                             tmp_path / "again", "--no-save-optim", "--no-save-rng",
                             "--log-throughput", "--log-interval", "1", "--manual-gc",
                             "--manual-gc-interval", "1"],
                         tmp_path)
        assert resumed.returncode == 0, resumed.output[-4000:]
        assert resumed.output.count("throughput per GPU (TFLOP/s/GPU): ") == 2
        saved = saved_keys(tmp_path / "again" / "iter_0000006")
        assert any(key.startswith("decoder") for key in saved)
        assert not any(key.startswith(("chained_", "rng_state")) for key in saved), saved
        assert any(key.startswith("chained_") for key in saved_keys(tmp_path / "ckpt" /
                                                                     "iter_0000004"))
        took = re.search(r"--use-checkpoint-args: from .*", resumed.output).group()
        for value in ("num_layers 4", "hidden_size 64", "num_query_groups 2", "swiglu True",
                      "normalization RMSNorm", "num_experts 8", "moe_grouped_gemm True",
                      "tokenizer_type Llama2Tokenizer", "tokenizer_model "):
            assert value in took, (value, took)
        assert f"resumed from {tmp_path / 'ckpt'} at iteration 4" in resumed.output
        assert [row["iteration"] for row in resumed.losses] == [5, 6]


def saved_keys(iteration_dir) -> list:
    """The names a checkpoint directory holds (model, optimizer "chained_*", "rng_state")."""
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(str(iteration_dir)).read_metadata().state_dict_metadata)


def saved_weights(iteration_dir) -> dict:
    """The model's tensors of a checkpoint directory, read in this process (no process group:
    torch's checkpoint reader, which megatron-core's torch_dist format is written with)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(iteration_dir))
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata) and "_extra_state" not in key
               and key.startswith(("embedding", "decoder", "output_layer"))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def test_overlap_param_gather_trains_and_saves_as_without(gpt_data, tmp_path):
    """--overlap-param-gather moves the distributed optimizer's gather into the next forward:
    the losses, the last validation and the saved weights are those of the run without it
    (a save or evaluation that read the parameters before gathering them would differ)."""
    flags = {"use-distributed-optimizer": True, "overlap-grad-reduce": True, "train-iters": 4,
             "eval-interval": 4, "save-interval": 3}  # the save at 3 follows no evaluation
    runs = {}
    for name, extra in (("plain", {}), ("overlapped", {"overlap-param-gather": True})):
        out = tmp_path / name
        out.mkdir()
        runs[name] = launch(2, tiny_gpt_args(gpt_data, **flags, **extra, save=out), out)
        assert runs[name].returncode == 0, runs[name].output[-4000:]
    assert "gathered bucket by bucket" in runs["overlapped"].output
    assert "gathered bucket by bucket" not in runs["plain"].output
    assert runs["overlapped"].loss() == runs["plain"].loss()
    end = [re.search(r"validation at iteration 4 .*", run.output).group() for run in runs.values()]
    assert end[0] == end[1]
    for iteration in ("iter_0000003", "iter_0000004"):
        plain, overlapped = (saved_weights(tmp_path / name / iteration) for name in runs)
        assert plain.keys() == overlapped.keys() and plain
        for key in plain:
            assert (plain[key] == overlapped[key]).all(), (iteration, key)


GPT3_LAYOUTS = {2: {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "1"},
                4: {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2"}}
GPT3_SIZES = {
    "--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4",
    "--seq-length": "64", "--max-position-embeddings": "64", "--global-batch-size": "4",
    "--rampup-batch-size": ["2", "2", "8"], "--train-iters": "24", "--lr-decay-iters": "24",
    "--log-interval": "1", "--save-interval": "24", "--eval-interval": "12", "--eval-iters": "1",
    "--split": "90,5,5"}


def ramped_sizes(iterations: int) -> list:
    """The global batch of each iteration by megatron-core's own calculator, fed the samples
    consumed before it (--rampup-batch-size 2 2 8 to 4, micro-batch 1, one data-parallel rank)."""
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator)

    ramp, consumed, sizes = RampupBatchsizeNumMicroBatchesCalculator(4, 1, 1, False, -1, 2, 2,
                                                                     8), 0, []
    for _ in range(iterations):
        ramp.update(consumed, consistency_check=True)
        sizes.append(ramp.get_current_global_batch_size())
        consumed += sizes[-1]
    return sizes


@pytest.mark.parametrize("nproc", [2, 4])
def test_gpt3_recipe_trains(nproc, gpt2_data, tmp_path):
    """examples/gpt3's arrays as published (fp16 with dynamic loss scaling, the batch-size
    ramp-up under --train-iters, --lr-warmup-fraction, GPT-2 BPE from --vocab-file and
    --merge-file without --tokenizer-type, --attention-backend auto) on 2 and 4 CPU ranks."""
    argv = recipes.argv(recipes.GPT3_175B, {**GPT3_SIZES, **GPT3_LAYOUTS[nproc]},
                        {"DATA_PATH": gpt2_data["prefix"], "VOCAB_FILE": gpt2_data["vocab_file"],
                         "MERGE_FILE": gpt2_data["merge_file"],
                         "CHECKPOINT_PATH": tmp_path / "ckpt",
                         "TENSORBOARD_LOGS_PATH": tmp_path / "tensorboard"})
    run = launch(nproc, argv, tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    assert [row["iteration"] for row in run.losses] == list(range(1, 25))
    assert [row.get("global batch size", 4) for row in run.losses] == ramped_sizes(24)
    # the default --initial-loss-scale 2^32 overflows fp16 gradients: steps are skipped, the
    # scale halved every --hysteresis 2 of them, until one step's gradients fit (at 2^19,
    # the 15th step, here)
    skipped = [row["number of skipped iterations"] for row in run.losses]
    first = skipped.index(0)
    assert first >= 2 and set(skipped[:first]) == {1} and skipped[-1] == 0
    assert run.losses[first]["loss scale"] <= 2.0 ** 32 / 2 ** (first // 2)
    assert all(0 < row["lm loss"] < 20 for row in run.losses[first:])
    saved = json.loads((tmp_path / "ckpt" / "iter_0000024" / "run.json").read_text())["args"]
    assert saved["tokenizer_type"] == "GPT2BPETokenizer" and saved["fp16"]
    assert list((tmp_path / "tensorboard").iterdir())


def test_readme_lists_every_megatron_only_flag_with_its_effect():
    """README's paragraph under the flags table: each row in the list of its effect."""
    readme = open("README.md").read()
    lists = {line.split(":")[0]: line for line in readme.splitlines()
             if line.startswith(("- no effect", "- accepted at this stack's", "- refused:"))}
    assert len(lists) == 3, lists.keys()
    for row in ROWS:
        where = ("- accepted at this stack's own value only, other values refused" if row.fine
                 else "- no effect (logged once)" if row.effect == "none" else "- refused")
        assert f"`{row.flag}" in lists[where], (row.flag, where)


def test_manual_gc_collects_at_the_interval_and_around_evaluations(monkeypatch):
    import gc

    from parm_trainer.training import manual_gc

    collected = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation))
    args = parse_args(["--manual-gc", "--manual-gc-interval", "3"])
    try:
        manual_gc.start(args)
        assert not gc.isenabled() and collected == [2]
        for iteration in range(1, 7):
            manual_gc.after_iteration(args, iteration)
        assert collected == [2, 2, 2]  # at start-up, after iterations 3 and 6
        with manual_gc.around_evaluation(args):
            pass
        assert collected == [2, 2, 2, 2, 0]  # before (all) and after (the young) as Megatron-LM
        with manual_gc.around_evaluation(parse_args(["--manual-gc", "--no-manual-gc-eval"])):
            pass
        assert len(collected) == 5
    finally:
        manual_gc.end(args)
    assert gc.isenabled()


def test_startup_objects_leave_the_collectors_walk():
    """freeze_startup (the trainer calls it once the model and optimizer are built): what exists
    then is out of every later full collection's walk (megatron-core's optimizer runs two in
    each save and load), while garbage made afterwards is still collected."""
    import gc

    from parm_trainer.training import manual_gc

    walked = len(gc.get_objects())  # what a full collection walks: not the frozen objects
    try:
        manual_gc.freeze_startup()
        assert gc.get_freeze_count() >= walked // 2 and len(gc.get_objects()) < walked // 10
        cycle = [[]]
        cycle[0].append(cycle)
        del cycle
        assert gc.collect() >= 2
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("env,length", [({}, ("train_iters", 300)),
                                        ({"TRAIN_SAMPLES": "640"}, ("train_samples", 640))])
def test_train_script_takes_iterations_or_samples(env, length):
    """scripts/train_gpt_moe.sh: TRAIN_SAMPLES trains a sample-based schedule (its flags are
    accepted together), else TRAIN_ITERS iterations; the arguments it would launch, parsed."""
    import os
    import subprocess

    printed = subprocess.run(["bash", "scripts/train_gpt_moe.sh"], capture_output=True, text=True,
                             env={**os.environ, "PYTHON": "echo", **env}, timeout=60, check=True)
    words = printed.stdout.split()
    args = parse_args(words[words.index("pretrain_gpt_moe.py") + 1:], world_size=4)
    assert getattr(args, length[0]) == length[1]
    assert (args.lr_warmup_fraction is not None) == ("TRAIN_SAMPLES" in env)
