"""Bad input on every entry point, checked in this process: one `error` line, a non-zero exit.

The cases of docs/bad_input.md that need no torchrun launch (tests/test_bad_input.py has those).
The training and generation entry points run their real main(argv): every check they make
before any communication is the same on every rank, so one process shows what each rank does.
Reaching the process groups means the input was not refused, and fails the case. The data and
conversion tools run their main(argv) too; the launchers run in bash and stop before Python.
"""

import json
import os
import subprocess

import pytest

from bad_input_fixtures import assert_refused, pretrain_argv
from conftest import ROOT

# (id, world size, flags, exit status, key words of the one error line)
PRETRAIN_CASES = [
    ("global_batch_vs_micro_x_dp", 2, ["--micro-batch-size", "4", "--global-batch-size", "6"], 1,
     ["--global-batch-size 6 is not divisible by --micro-batch-size 4 x data-parallel size 2"]),
    ("heads_vs_tp", 2, ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
                        "--hidden-size", "66"], 1,
     ["--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"]),
    ("topk_over_experts", 1, ["--moe-router-topk", "5"], 1,
     ["--moe-router-topk 5 must be between 1 and --num-experts 4"]),
    ("pp_vs_layers", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "3"], 1,
     ["--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"]),
    # pipeline stages (--num-layers 2 unless given)
    ("layout_layer_count", 2, ["--pipeline-model-parallel-size", "2",
                               "--pipeline-model-parallel-layout", "Ett|tL"], 1,
     ["--pipeline-model-parallel-layout 'Ett|tL' has 3 decoder layers (t), --num-layers is 2"]),
    ("layout_embedding_not_first", 2, ["--pipeline-model-parallel-size", "2",
                                       "--pipeline-model-parallel-layout", "tE|tL"], 1,
     ["'tE|tL': E (the embedding) must come first in the first stage"]),
    ("layout_loss_not_last", 2, ["--pipeline-model-parallel-size", "2",
                                 "--pipeline-model-parallel-layout", "Et|Lt"], 1,
     ["'Et|Lt': L (the loss) must come last in the last stage"]),
    ("layout_stages_vs_pp", 2, ["--pipeline-model-parallel-size", "2",
                                "--pipeline-model-parallel-layout", "Et|t|L"], 1,
     ["'Et|t|L' has 3 stages, not a multiple of --pipeline-model-parallel-size 2"]),
    ("layout_empty_stage", 3, ["--pipeline-model-parallel-size", "3",
                               "--pipeline-model-parallel-layout", "Ett||L"], 1,
     ["'Ett||L': stage 1 is empty"]),
    ("layout_bad_letter", 2, ["--pipeline-model-parallel-size", "2",
                              "--pipeline-model-parallel-layout", "Et|xL"], 1,
     ["'Et|xL': Invalid layer character: x"]),
    # a memory limit (--memory-gb, per rank) that no layout meets: the given one, and auto's
    ("memory_limit_not_met", 2, ["--tensor-model-parallel-size", "2", "--memory-gb", "0.001"],
     1, ["--memory-gb 0.001: this layout needs an estimated 0.01 GiB on pipeline rank 0"]),
    ("memory_limit_auto_stages", 2, ["--pipeline-model-parallel-size", "2", "--memory-gb",
                                     "0.001", "--pipeline-model-parallel-layout", "auto"], 1,
     ["--pipeline-model-parallel-layout auto: no split into 2 stages fits the memory limit of "
      "0.001 GiB per rank, nor with activation recomputation (tried 4 settings)"]),
    ("layout_with_first_stage", 2, ["--pipeline-model-parallel-size", "2",
                                    "--pipeline-model-parallel-layout", "Et|tL",
                                    "--decoder-first-pipeline-num-layers", "1"], 1,
     ["--decoder-first-pipeline-num-layers and --pipeline-model-parallel-layout exclude each "
      "other"]),
    ("first_stage_takes_every_layer", 2, ["--pipeline-model-parallel-size", "2",
                                          "--decoder-first-pipeline-num-layers", "2"], 1,
     ["--decoder-first-pipeline-num-layers 2 leave 0 of --num-layers 2 for the 1 other stage"]),
    ("virtual_stages_do_not_divide", 2, ["--pipeline-model-parallel-size", "2",
                                         "--num-virtual-stages-per-pipeline-rank", "2"], 1,
     ["--num-virtual-stages-per-pipeline-rank 2 does not divide each stage's layers (1"]),
    ("interleaved_micro_batches", 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                      "--num-virtual-stages-per-pipeline-rank", "2",
                                      "--global-batch-size", "6"], 1,
     ["the interleaved schedule (2 virtual stages per rank) needs the micro-batches per "
      "iteration (3 = --global-batch-size 6", "a multiple of --pipeline-model-parallel-size 2"]),
    ("moe_layer_freq_list_length", 1, ["--moe-layer-freq", "[1,0,1]"], 1,
     ["--moe-layer-freq lists 3 layers, --num-layers is 2"]),
    ("moe_layer_freq_not_a_pattern", 1, ["--moe-layer-freq", "[1,2]"], 2,
     ["argument --moe-layer-freq: '[1,2]' is not a list of 1s (MoE) and 0s (dense layers)"]),
    ("unknown_schedule", 1, ["--moe-parm-schedule", "s3"], 2,
     ["argument --moe-parm-schedule: invalid choice: 's3'"]),
    ("unknown_flag", 1, ["--num-expert", "4"], 2, ["unrecognized arguments: --num-expert 4"]),
    ("zero_heads", 1, ["--num-attention-heads", "0"], 1,
     ["--num-attention-heads must be at least 1, got 0"]),
    ("seq_over_position_table", 1, ["--seq-length", "128", "--max-position-embeddings", "64"],
     1, ["--seq-length 128 is longer than --max-position-embeddings 64"]),
    ("capacity_factor_negative", 1, ["--moe-expert-capacity-factor", "-1"], 1,
     ["--moe-expert-capacity-factor must be positive, got -1.0"]),
    ("min_lr_over_lr", 1, ["--lr", "1e-4", "--min-lr", "1e-3"], 1,
     ["--min-lr 0.001 must be between 0 and --lr 0.0001"]),
    ("negative_split", 1, ["--split", "100,-1,1"], 1,
     ["--split '100,-1,1' must be up to three non-negative", "e.g. 969,30,1"]),
    ("negative_num_workers", 1, ["--num-workers", "-1"], 1,
     ["--num-workers must not be negative, got -1"]),
    ("missing_tokenizer_model", 1, ["--tokenizer-model", "{junk}/nothing.model"], 1,
     ["--tokenizer-model {junk}/nothing.model: no such file"]),
    ("garbage_tokenizer_model", 1, ["--tokenizer-model", "{junk}/garbage.model"], 1,
     ["--tokenizer-model {junk}/garbage.model is not a SentencePiece model",
      "tools/train_tokenizer.py"]),
    ("unsupported_tokenizer_type", 1, ["--tokenizer-type", "TikTokenizer"], 1,
     ["unsupported --tokenizer-type 'TikTokenizer'; choose from SentencePieceTokenizer, "
      "Llama2Tokenizer, GPT2BPETokenizer, NullTokenizer"]),
    # the tokenizer types' flags and files (parm_trainer/data/tokenizer.py)
    ("no_tokenizer_model", 1, ["--tokenizer-model", ""], 1,
     ["--tokenizer-model is required with --tokenizer-type SentencePieceTokenizer",
      "for GPT-2 BPE give --vocab-file and --merge-file"]),
    ("tokenizer_model_a_directory", 1, ["--tokenizer-model", "{junk}"], 1,
     ["--tokenizer-model {junk} is not a file"]),
    ("load_is_a_file", 1, ["--load", "{junk}/garbage.model"], 1,
     ["--load {junk}/garbage.model is not a directory"]),
    ("save_is_a_file", 1, ["--save", "{junk}/garbage.model"], 1,
     ["--save {junk}/garbage.model is not a directory"]),
    ("load_tracker_not_a_number", 1, ["--load", "{junk}/bad_tracker"], 1,
     ["--load {junk}/bad_tracker:", "should hold an iteration number, found 'not-a-number'"]),
    ("cost_profile_not_json", 1, ["--moe-parm-schedule", "auto", "--moe-parm-cost-profile",
                                  "{junk}/not_json.json"], 1,
     ["cost profile {junk}/not_json.json: not valid JSON"]),
    # the libraries a layer implementation needs, and megatron's GroupedMLP's own limits
    ("transformer_engine_missing", 1, ["--transformer-impl", "transformer_engine"], 1,
     ["--transformer-impl transformer_engine: Transformer Engine is not installed"]),
    ("grouped_gemm_fp32", 1, ["--moe-grouped-gemm"], 1,
     ["--moe-grouped-gemm with --transformer-impl local runs megatron-core's GroupedMLP, "
      "which needs --bf16"]),
    # mixed precision: Megatron-LM's validate_args, megatron-core's grad scalers
    ("cost_profile_missing", 1, ["--moe-parm-schedule", "auto", "--moe-parm-cost-profile",
                                 "{junk}/nothing.json"], 1,
     ["--moe-parm-cost-profile {junk}/nothing.json: no such file"]),
    # today's MoE blocks (parm_trainer/moe_flags.py), as megatron-core's TransformerConfig
    ("shared_expert_zero", 1, ["--moe-shared-expert-intermediate-size", "0"], 1,
     ["--moe-shared-expert-intermediate-size must be at least 1, got 0"]),
    # multi-latent attention (parm_trainer/mla_flags.py)
    ("mla_with_gqa", 1, ["--multi-latent-attention", "--group-query-attention"], 1,
     ["--multi-latent-attention and --group-query-attention exclude each other"]),
    ("mla_odd_rope_dim", 1, ["--multi-latent-attention", "--qk-pos-emb-head-dim", "7"], 1,
     ["--qk-pos-emb-head-dim 7 must be even"]),
    ("mla_latent_vs_tp", 2, ["--multi-latent-attention", "--q-lora-rank", "15",
                             "--tensor-model-parallel-size", "2"], 1,
     ["--q-lora-rank (15) must be divisible by --tensor-model-parallel-size 2"]),
    ("yarn_without_mla", 1, ["--rope-type", "yarn"], 1,
     ["--rope-type yarn needs --multi-latent-attention"]),
    ("expert_bias_with_softmax", 1, ["--moe-router-enable-expert-bias"], 1,
     ["--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"]),
    ("bias_update_rate_negative", 1, ["--moe-router-bias-update-rate", "-0.1"], 1,
     ["--moe-router-bias-update-rate must not be negative, got -0.1"]),
    ("scaling_factor_zero", 1, ["--moe-router-topk-scaling-factor", "0"], 1,
     ["--moe-router-topk-scaling-factor must be positive, got 0.0"]),
    ("group_topk_without_groups", 1, ["--moe-router-group-topk", "1"], 1,
     ["--moe-router-group-topk needs --moe-router-num-groups"]),
    ("experts_vs_groups", 1, ["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     1, ["--num-experts 4 is not divisible by --moe-router-num-groups 3"]),
    ("group_topk_over_groups", 1, ["--moe-router-num-groups", "2", "--moe-router-group-topk",
                                   "3"], 1,
     ["--moe-router-group-topk 3 must not exceed --moe-router-num-groups 2"]),
    ("topk_over_chosen_groups", 1, ["--moe-router-num-groups", "4", "--moe-router-group-topk",
                                    "1"], 1,
     ["--moe-router-topk 2 is more than the 1 experts of --moe-router-group-topk 1 groups"]),
    ("shared_overlap_allgather", 1, ["--moe-shared-expert-intermediate-size", "8",
                                     "--moe-shared-expert-overlap", "--moe-parm-schedule",
                                     "megatron", "--moe-token-dispatcher-type", "allgather"], 1,
     ["--moe-shared-expert-overlap with --moe-parm-schedule megatron works with "
      "--moe-token-dispatcher-type alltoall only"]),
    ("unknown_score_function", 1, ["--moe-router-score-function", "relu"], 2,
     ["argument --moe-router-score-function: invalid choice: 'relu'"]),
    # training schedules: iteration- or sample-based, warmups, the batch-size ramp-up
]


@pytest.mark.parametrize("world,flags,status,needles", [c[1:] for c in PRETRAIN_CASES],
                         ids=[c[0] for c in PRETRAIN_CASES])
def test_pretrain_gpt_refuses(world, flags, status, needles, entry, gpt_data, junk, capsys):
    main = entry("pretrain_gpt_moe.py", world)
    argv = [flag.format(junk=junk) for flag in pretrain_argv(gpt_data, *flags)]
    assert_refused(main, argv, capsys, status, *(n.format(junk=junk) for n in needles))


def _numeric_flags(script: str):
    """(flag, dest, type, values it takes) of every int or float flag of an entry point's
    parser (values: 1, or nargs for one that takes several, as --rampup-batch-size)."""
    from parm_trainer.arguments import add_bert_args, build_parser

    extra = add_bert_args if script == "pretrain_bert_moe.py" else None
    return [(action.option_strings[0], action.dest, action.type,
             action.nargs if isinstance(action.nargs, int) else 1)
            for action in build_parser(extra)._actions
            if action.type in (int, float) and not action.choices]


def _outside(bounds, kind):
    """Values outside the range, as a user could type them (NaN and infinity for floats)."""
    low, high, low_in, high_in = bounds
    values = [low - 1 if low_in else low]
    if high is not None:
        values.append(high + 1 if high_in else high)
    if kind is float:
        values += [float("nan"), float("inf")]
    return values


@pytest.mark.parametrize("script", ["pretrain_gpt_moe.py", "pretrain_bert_moe.py"])
def test_every_numeric_flag_has_its_range(script, entry, gpt_data, capsys):
    """Every int and float flag of the entry point has a row in flag_ranges.RANGES (a new flag
    without one fails here), and each value outside it (below, above, NaN, infinite) is
    refused with one line naming the flag, before the process groups."""
    from parm_trainer import flag_ranges

    main = entry(script)
    flags = _numeric_flags(script)
    assert len(flags) > 40 if script == "pretrain_gpt_moe.py" else flags
    missing = [flag for flag, dest, _, _ in flags if dest not in flag_ranges.RANGES]
    assert not missing, f"no range in parm_trainer/flag_ranges.py for {missing}"
    for flag, dest, kind, count in flags:
        for value in _outside(flag_ranges.RANGES[dest], kind):
            argv = pretrain_argv(gpt_data, flag, *[kind(value)] * count)
            assert_refused(main, argv, capsys, 1, f"{flag} must ")


@pytest.mark.parametrize("blend,needle", [
    (["-0.5", "{p}", "1", "{p}"], "each blend weight must be a finite number >= 0 and their sum "
                                  "positive, got -0.5"),
    (["0", "{p}", "0", "{p}"], "their sum positive"),
    (["nan", "{p}"], "got nan"),
    (["0.3", "{p}", "0.7"], "expected 'weight prefix' pairs, got 3 words"),
])
def test_pretrain_gpt_refuses_a_bad_blend(blend, needle, entry, gpt_data, capsys):
    main = entry("pretrain_gpt_moe.py")
    words = [word.format(p=gpt_data["prefix"]) for word in blend]
    assert_refused(main, pretrain_argv(gpt_data, "--data-path", *words), capsys, 1,
                   "--data-path", needle)


def test_pretrain_bert_refuses_mock_data(entry, gpt_data, capsys):
    main = entry("pretrain_bert_moe.py")
    argv = pretrain_argv(gpt_data, "--mock-data")
    del argv[:2]  # no --data-path
    assert_refused(main, argv, capsys, 1, "--mock-data is for GPT (megatron-core has no mock "
                   "BERT dataset)")


def test_pretrain_bert_refuses_mtp(entry, gpt_data, capsys):
    main = entry("pretrain_bert_moe.py")
    argv = pretrain_argv(gpt_data, "--mtp-num-layers", "1", "--position-embedding-type", "rope")
    assert_refused(main, argv, capsys, 1, "--mtp-num-layers 1 is for GPT: BERT predicts masked "
                   "tokens")


def test_pretrain_bert_refuses_a_mask_probability_over_one(entry, gpt_data, capsys):
    main = entry("pretrain_bert_moe.py")
    assert_refused(main, pretrain_argv(gpt_data, "--mask-prob", "1.5"), capsys, 1,
                   "--mask-prob must be in (0, 1), got 1.5")


def test_pretrain_bert_refuses_a_tokenizer_without_bert_symbols(entry, gpt_data, capsys):
    main = entry("pretrain_bert_moe.py")
    assert_refused(main, pretrain_argv(gpt_data, "--tokenizer-type", "Llama2Tokenizer"), capsys,
                   1, "--tokenizer-type Llama2Tokenizer has no [CLS], [SEP] and [MASK] tokens",
                   "needs --tokenizer-type SentencePieceTokenizer")


@pytest.mark.parametrize("case", ["missing_dir", "bert_checkpoint", "no_tokenizer", "no_vocab",
                                  "no_prompt", "negative_top_k", "layout_over_world"])
def test_generate_refuses(case, entry, junk, capsys):
    main = entry("tools/generate.py")
    argv, status, needles = {
        "missing_dir": (["--load-dir", junk / "nowhere", "--prompt", "x"], 1,
                        [f"--load-dir {junk}/nowhere is not a parm_trainer checkpoint directory"]),
        "bert_checkpoint": (["--load-dir", junk / "bert_ckpt", "--prompt", "x"], 1,
                            ["holds an MoE BERT model", "GPT-MoE checkpoints"]),
        "no_tokenizer": (["--load-dir", junk / "no_tokenizer_ckpt", "--prompt", "x"], 1,
                         ["no tokenizer.model in", "give --tokenizer-model"]),
        "no_vocab": (["--load-dir", junk / "no_vocab_ckpt", "--prompt", "x"], 1,
                     ["no vocab.json in", "give --vocab-file"]),
        "no_prompt": (["--load-dir", junk / "bert_ckpt"], 2,
                      ["the following arguments are required: --prompt"]),
        "negative_top_k": (["--load-dir", junk / "bert_ckpt", "--prompt", "x", "--top-k", "-1"],
                           2, ["argument --top-k: must not be negative, got -1"]),
        "layout_over_world": (["--load-dir", junk / "no_tokenizer_ckpt", "--prompt", "x",
                               "--tokenizer-model", junk / "garbage.model",
                               "--tensor-model-parallel-size", "2"], 1,
                              ["--tensor-model-parallel-size 2", "world size 1"]),
    }[case]
    assert_refused(main, argv, capsys, status, *needles)


def test_generate_help_exits_0(entry, capsys):
    with pytest.raises(SystemExit) as ended:
        entry("tools/generate.py")(["--help"])
    assert ended.value.code == 0
    assert "pretrain_gpt_moe.py's: see its --help" in capsys.readouterr().out


def test_generate_refuses_virtual_stages(entry, junk, capsys):
    main = entry("tools/generate.py", 2)
    argv = ["--load-dir", junk / "no_tokenizer_ckpt", "--prompt", "x", "--tokenizer-model",
            junk / "garbage.model", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
            "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "4"]
    assert_refused(main, argv, capsys, 1, "tools/generate.py runs one model chunk per pipeline "
                                          "rank")


MIXTRAL_CONFIG = {"model_type": "mixtral", "vocab_size": 2048, "hidden_size": 64,
                  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                  "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def test_convert_refuses(entry, junk, capsys):
    main = entry("tools/checkpoint/convert.py")
    out = junk / "convert_out"
    mixtral = junk / "mixtral"
    mixtral.mkdir(exist_ok=True)
    (mixtral / "config.json").write_text(json.dumps(MIXTRAL_CONFIG))
    for argv, status, needles in [
        (["--loader", "parm", "--saver", "hf", "--load-dir", junk / "bad_tracker"], 2,
         ["the following arguments are required: --save-dir"]),
        (["--loader", "parm", "--saver", "hf", "--load-dir", junk / "bad_tracker",
          "--save-dir", out], 1, ["should hold an iteration number, found 'not-a-number'"]),
        (["--loader", "hf", "--saver", "hf", "--load-dir", junk, "--save-dir", out], 1,
         ["--loader hf --saver hf: nothing to convert"]),
        (["--loader", "hf", "--saver", "parm", "--load-dir", mixtral, "--save-dir", out], 1,
         [f"{mixtral} has no tokenizer.model (SentencePiece) nor tokenizer.json (Hugging Face): "
          f"give --tokenizer-model"]),
        (["--loader", "hf", "--saver", "parm", "--load-dir", mixtral, "--save-dir", out,
          "--tokenizer-model", junk / "garbage.model"], 1,
         [f"--tokenizer-model {junk}/garbage.model is not a SentencePiece model"]),
        (["--loader", "parm", "--saver", "hf", "--load-dir", junk / "no_vocab_ckpt",
          "--save-dir", out], 1,
         ["was trained with --tokenizer-type GPT2BPETokenizer; the Hugging Face export carries "
          "SentencePiece and HuggingFaceTokenizer tokenizers only"]),
    ]:
        assert_refused(main, argv, capsys, status, *needles)
        assert not out.exists()


def _preprocess_argv(junk, source, *flags, tokenizer=None):
    return ["--input", junk / source, "--output-prefix", junk / "pre" / "out",
            "--tokenizer-model", tokenizer or junk / "garbage.model", *flags]


def test_preprocess_data_refuses(entry, junk, gpt_data, capsys):
    main = entry("tools/preprocess_data.py")
    model = gpt_data["tokenizer"]
    for argv, status, needles in [
        (_preprocess_argv(junk, "one.jsonl", tokenizer=junk / "nothing.model"), 1,
         [f"--tokenizer-model {junk}/nothing.model: no such file"]),
        (_preprocess_argv(junk, "one.jsonl", "--vocab-file", junk / "nothing.json",
                          "--merge-file", junk / "merges.txt"), 1,
         [f"--vocab-file {junk}/nothing.json: no such file"]),
        (_preprocess_argv(junk, "one.jsonl", "--tokenizer-type", "NullTokenizer"), 1,
         ["--vocab-size is required with --tokenizer-type NullTokenizer"]),
        (_preprocess_argv(junk, "one.jsonl", "--tokenizer-type", "NullTokenizer",
                          "--vocab-size", "10"), 1,
         ["--tokenizer-type NullTokenizer reads token ids separated by single spaces, got "
          "'One short document.'"]),
        (_preprocess_argv(junk, "one.jsonl"), 1,
         [f"--tokenizer-model {junk}/garbage.model is not a SentencePiece model"]),
        (_preprocess_argv(junk, "blank.jsonl", tokenizer=model), 1,
         [f"--input {junk}/blank.jsonl holds no documents"]),
        (_preprocess_argv(junk, "binary.jsonl", tokenizer=model), 1,
         [f"--input {junk}/binary.jsonl is not UTF-8 text"]),
        (_preprocess_argv(junk, "one.jsonl", "--workers", "0", tokenizer=model), 2,
         ["--workers, --chunksize and --log-interval must be >= 1"]),
        (["--input", junk / "one.jsonl", "--output-prefix", junk / "garbage.model" / "out",
          "--tokenizer-model", model], 1,
         [f"--output-prefix {junk}/garbage.model/out: cannot create"]),
    ]:
        assert_refused(main, argv, capsys, status, *needles)
        assert not list((junk / "pre").glob("out*"))  # nothing half-written left


def test_train_tokenizer_refuses(entry, junk, capsys):
    main = entry("tools/train_tokenizer.py")
    for source, flags, needles in [
        ("nothing.jsonl", [], [f"--input {junk}/nothing.jsonl not found"]),
        ("blank.jsonl", [], [f"--input {junk}/blank.jsonl has no text to train on"]),
        ("binary.jsonl", [], [f"--input {junk}/binary.jsonl is not UTF-8 text"]),
        ("one.jsonl", ["--vocab-size", "5"], ["sentencepiece cannot train --vocab-size 5",
                                              "Vocabulary size is smaller than required_chars"]),
    ]:
        argv = ["--input", junk / source, "--output-prefix", junk / "tok" / "t", *flags]
        assert_refused(main, argv, capsys, 1, *needles)
        assert not list((junk / "tok").glob("t.*"))


@pytest.mark.parametrize("script,env,args,needle", [
    ("launch.sh", {}, [], "error: no script to run; usage: bash scripts/launch.sh SCRIPT"),
    ("launch.sh", {}, ["pretrain_gtp_moe.py"],
     "error: scripts/launch.sh: no such script pretrain_gtp_moe.py"),
    ("launch.sh", {"NNODES": "two"}, ["pretrain_gpt_moe.py"],
     "error: NNODES=two must be a whole number"),
    ("train_gpt_moe.sh", {"TP": "abc"}, [], "error: TP=abc must be a positive whole number"),
    ("train_gpt_moe.sh", {"PRETRAIN": "nothing.py"}, [],
     "error: scripts/launch.sh: no such script nothing.py"),
    ("train_bert_moe.sh", {"EP": "0"}, [], "error: EP=0 must be a positive whole number"),
], ids=["launch_no_script", "launch_missing_script", "launch_nnodes", "train_gpt_tp",
        "train_gpt_pretrain", "train_bert_ep"])
def test_launchers_refuse(script, env, args, needle):
    # PYTHON=echo: a launcher that failed to refuse would print torchrun's command and exit 0
    result = subprocess.run(["bash", f"scripts/{script}", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHON": "echo", **env})
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(needle), line


def test_torchrun_command_must_exist(monkeypatch):
    """PARM_TORCHRUN (the command the tools start torchrun with) naming no command: one line,
    status 1, from a tool's --nproc; unset, this Python's torchrun; set, its words."""
    import sys

    from conftest import python
    from parm_trainer.launch import torchrun_command

    given = "no-such-torchrun -m torch.distributed.run"
    result = python("tools/calibrate_comm.py", "--nproc", "2", "--output", "/dev/null",
                    env={"PARM_TORCHRUN": given}, timeout=60)
    assert result.returncode == 1 and result.stdout == "", result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line == (f"error: PARM_TORCHRUN={given!r}: no command 'no-such-torchrun' (unset it "
                    "to run this Python's -m torch.distributed.run)"), line
    monkeypatch.delenv("PARM_TORCHRUN", raising=False)
    assert torchrun_command() == [sys.executable, "-m", "torch.distributed.run"]
    monkeypatch.setenv("PARM_TORCHRUN", "env 'torchrun' --flag")
    assert torchrun_command() == ["env", "torchrun", "--flag"]
