"""Bad input on the flags of Megatron-LM's recipes, checked in this process: one `error` line.

The flags a Megatron-LM script brings (arguments/megatron_only.py, the tokenizers, --fp16 and
its loss scaling, sample-based schedules and the batch-size ramp-up, --overlap-param-gather,
--mock-data, --use-checkpoint-args): docs/bad_input.md's rows for them. The entry point runs
its real main(argv) as tests/test_bad_input_inprocess.py's cases do (tests/bad_input_fixtures.py).
"""

import pytest

from bad_input_fixtures import assert_refused, pretrain_argv

# (id, world size, flags, exit status, key words of the one error line)
RECIPE_FLAG_CASES = [
    # HuggingFaceTokenizer: a directory saved by transformers (parm_trainer/data/hf_tokenizer.py)
    ("hf_tokenizer_not_a_directory", 1, ["--tokenizer-type", "HuggingFaceTokenizer",
                                         "--tokenizer-model", "{junk}/garbage.model"], 1,
     ["--tokenizer-model {junk}/garbage.model: not a directory (HuggingFaceTokenizer reads"]),
    ("hf_tokenizer_without_its_files", 1, ["--tokenizer-type", "HuggingFaceTokenizer",
                                           "--tokenizer-model", "{junk}/bad_tracker"], 1,
     ["--tokenizer-model {junk}/bad_tracker holds no tokenizer.json nor tokenizer_config.json"]),
    # Megatron-LM flags this stack has no such thing for (arguments/megatron_only.py)
    ("megatron_fp8", 1, ["--fp8", "hybrid"], 1,
     ["--fp8 hybrid is not supported here: FP8 needs Transformer Engine"]),
    ("megatron_context_parallel", 1, ["--context-parallel-size", "2"], 1,
     ["--context-parallel-size 2 is not supported here: no context parallelism"]),
    ("megatron_flex_dispatcher", 1, ["--moe-token-dispatcher-type", "flex"], 1,
     ["--moe-token-dispatcher-type flex is not supported here: use --moe-parm-schedule auto"]),
    ("megatron_ckpt_format", 1, ["--ckpt-format", "torch"], 1,
     ["--ckpt-format torch is not supported here: checkpoints are megatron-core's torch_dist"]),
    ("overlap_param_gather_alone", 2, ["--overlap-param-gather", "--overlap-grad-reduce"], 1,
     ["--overlap-param-gather needs --use-distributed-optimizer"]),
    ("overlap_param_gather_no_grad_reduce", 2, ["--overlap-param-gather",
                                                "--use-distributed-optimizer"], 1,
     ["--overlap-param-gather needs --overlap-grad-reduce"]),
    ("no_position_embedding_learned", 1, ["--no-position-embedding"], 1,
     ["--no-position-embedding is deprecated in Megatron-LM and valid only with "
      "--position-embedding-type rope"]),
    ("mock_data_and_data_path", 1, ["--mock-data"], 1,
     ["--mock-data trains on synthetic data: leave out --data-path"]),
    ("checkpoint_args_unreadable", 1, ["--use-checkpoint-args", "--load", "{junk}/bad_tracker"],
     1, ["latest_checkpointed_iteration.txt should hold an iteration number"]),
    ("gpt2_without_merge_file", 1, ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                    "{junk}/vocab.json"], 1,
     ["--merge-file is required with --tokenizer-type GPT2BPETokenizer"]),
    ("gpt2_vocab_file_missing", 1, ["--vocab-file", "{junk}/nothing.json", "--merge-file",
                                    "{junk}/merges.txt"], 1,
     ["--vocab-file {junk}/nothing.json: no such file"]),
    ("gpt2_vocab_not_json", 1, ["--vocab-file", "{junk}/not_json.json", "--merge-file",
                                "{junk}/merges.txt"], 1,
     ["--vocab-file {junk}/not_json.json is not a GPT-2 BPE vocabulary (JSON of token: id)"]),
    ("gpt2_vocab_without_eod", 1, ["--vocab-file", "{junk}/vocab_no_eod.json", "--merge-file",
                                   "{junk}/merges.txt"], 1,
     ["--vocab-file {junk}/vocab_no_eod.json has no <|endoftext|> token"]),
    ("gpt2_merge_outside_vocab", 1, ["--vocab-file", "{junk}/vocab.json", "--merge-file",
                                     "{junk}/merges.txt"], 1,
     ["--merge-file {junk}/merges.txt line 2 joins 'a' and 'b', which --vocab-file "
      "{junk}/vocab.json does not hold with their join"]),
    ("null_without_vocab_size", 1, ["--tokenizer-type", "NullTokenizer"], 1,
     ["--vocab-size is required with --tokenizer-type NullTokenizer"]),
    ("llama2_on_garbage", 1, ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                              "{junk}/garbage.model"], 1,
     ["--tokenizer-model {junk}/garbage.model is not a SentencePiece model"]),
    ("fp16_with_bf16", 1, ["--fp16", "--bf16"], 1,
     ["--fp16 and --bf16 exclude each other: choose one"]),
    ("min_loss_scale_over_initial", 1, ["--fp16", "--initial-loss-scale", "4",
                                        "--min-loss-scale", "8"], 1,
     ["--min-loss-scale 8 must not exceed --initial-loss-scale 4"]),
    ("fractional_loss_scale_window", 1, ["--fp16", "--loss-scale-window", "1.5"], 1,
     ["--loss-scale-window 1.5 must be a whole number of iterations"]),
    ("negative_loss_scale", 1, ["--fp16", "--loss-scale", "-1"], 1,
     ["--loss-scale must not be negative, got -1.0"]),
    ("grouped_gemm_fp16", 1, ["--fp16", "--moe-grouped-gemm"], 1,
     ["--moe-grouped-gemm with --transformer-impl local runs megatron-core's GroupedMLP, "
      "which needs --bf16"]),
    ("train_iters_and_samples", 1, ["--train-iters", "10", "--train-samples", "100"], 1,
     ["--train-iters and --train-samples exclude each other"]),
    ("decay_samples_with_iters", 1, ["--train-iters", "10", "--lr-decay-samples", "100"], 1,
     ["--lr-decay-samples needs sample-based training (--train-samples); this run counts "
      "iterations (--train-iters)"]),
    ("decay_iters_with_samples", 1, ["--train-samples", "100", "--lr-decay-iters", "10"], 1,
     ["--lr-decay-iters needs iteration-based training (--train-iters); this run counts "
      "samples (--train-samples)"]),
    ("warmup_fraction_and_iters", 1, ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"],
     1, ["--lr-warmup-fraction and --lr-warmup-iters exclude each other"]),
    ("warmup_samples_over_decay", 1, ["--train-samples", "100", "--lr-warmup-samples", "100"],
     1, ["--lr-warmup-samples 100 must be smaller than --lr-decay-samples 100 (default "
         "--train-samples)"]),
    ("warmup_init_over_lr", 1, ["--lr", "1e-4", "--lr-warmup-init", "1e-3"], 1,
     ["--lr-warmup-init 0.001 must not exceed --lr 0.0001"]),
    ("train_samples_under_a_batch", 1, ["--train-samples", "7", "--global-batch-size", "8"], 1,
     ["--train-samples 7 is less than one global batch (--global-batch-size 8)"]),
    ("rampup_start_not_below_global", 1, ["--train-samples", "100", "--global-batch-size", "8",
                                          "--rampup-batch-size", "8", "2", "50"], 1,
     ["--rampup-batch-size starts at 8, which must be smaller than --global-batch-size 8"]),
    ("rampup_increment_vs_span", 1, ["--train-samples", "100", "--global-batch-size", "8",
                                     "--rampup-batch-size", "2", "4", "50"], 1,
     ["--rampup-batch-size increment 4 does not divide --global-batch-size 8 - start 2 = 6"]),
    ("rampup_start_vs_micro_x_dp", 2, ["--train-samples", "100", "--global-batch-size", "16",
                                       "--rampup-batch-size", "2", "2", "50"], 1,
     ["--rampup-batch-size start 2 is not divisible by --micro-batch-size 2 x data-parallel "
      "size 2"]),
    ("rampup_interleaved_micro_batches", 2,
     ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
      "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "1",
      "--global-batch-size", "8", "--train-samples", "100", "--rampup-batch-size", "2", "1",
      "20"], 1,
     ["the interleaved schedule needs the micro-batches of every iteration to be a multiple of "
      "--pipeline-model-parallel-size 2: --rampup-batch-size increment 1 is 1"]),
]
# activation recomputation (parm_trainer/arguments/recompute.py), on 2 layers
RECIPE_FLAG_CASES += [
    ("recompute_method_without_full", 1, ["--recompute-method", "uniform"], 1,
     ["--recompute-method uniform needs --recompute-granularity full"]),
    ("recompute_full_without_method", 1, ["--recompute-granularity", "full"], 1,
     ["--recompute-granularity full needs --recompute-method uniform or block"]),
    ("recompute_num_layers_out_of_range", 1, ["--recompute-granularity", "full",
                                              "--recompute-method", "block",
                                              "--recompute-num-layers", "3"], 1,
     ["--recompute-num-layers 3 is out of range: with --recompute-granularity full it must be "
      "between 1 and the layers per pipeline stage, 2"]),
    ("recompute_num_layers_selective", 1, ["--recompute-granularity", "selective",
                                           "--recompute-num-layers", "1"], 1,
     ["--recompute-num-layers 1 needs --recompute-granularity full"]),
    ("recompute_unknown_module", 1, ["--recompute-granularity", "selective",
                                     "--recompute-modules", "attention"], 1,
     ["--recompute-modules attention: unknown; choose from core_attn, moe_act, layernorm"]),
    ("recompute_moe_act_sequential", 1, ["--recompute-granularity", "selective",
                                         "--recompute-modules", "moe_act"], 1,
     ["--recompute-modules moe_act needs --moe-grouped-gemm"]),
    ("recompute_mla_up_proj", 1, ["--recompute-granularity", "selective",
                                  "--recompute-modules", "mla_up_proj"], 1,
     ["--recompute-modules mla_up_proj needs multi-latent attention (--multi-latent-attention)"]),
    ("recompute_mla_up_proj_mla", 1, ["--recompute-granularity", "selective",
                                      "--recompute-modules", "mla_up_proj",
                                      "--multi-latent-attention"], 1,
     ["--recompute-modules mla_up_proj is not built yet for this stack's multi-latent"]),
    ("recompute_shared_overlapped", 1, ["--recompute-granularity", "selective",
                                        "--recompute-modules", "shared_experts",
                                        "--moe-shared-expert-intermediate-size", "64",
                                        "--moe-shared-expert-overlap"], 1,
     ["--recompute-modules shared_experts cannot work with --moe-shared-expert-overlap"]),
    ("moe_layer_recompute_full", 1, ["--moe-layer-recompute", "--recompute-granularity", "full",
                                     "--recompute-method", "block",
                                     "--recompute-num-layers", "1"], 1,
     ["--moe-layer-recompute with --recompute-granularity full"]),
    ("recompute_modules_without_selective", 1, ["--recompute-modules", "moe"], 1,
     ["--recompute-modules needs --recompute-granularity selective"]),
]

# multi-token prediction (parm_trainer/mtp_flags.py, planning/layout.py)
ROPE = ["--position-embedding-type", "rope"]
RECIPE_FLAG_CASES += [
    ("mtp_zero_layers", 1, ["--mtp-num-layers", "0", *ROPE], 1,
     ["--mtp-num-layers must be at least 1, got 0"]),
    ("mtp_negative_scaling", 1, ["--mtp-num-layers", "1", *ROPE, "--mtp-loss-scaling-factor",
                                 "-1"], 1, ["--mtp-loss-scaling-factor must not be negative"]),
    ("mtp_learned_positions", 1, ["--mtp-num-layers", "1"], 1,
     ["--mtp-num-layers 1 needs --position-embedding-type rope"]),
    ("mtp_tied_pipeline", 2, ["--mtp-num-layers", "1", *ROPE,
                              "--pipeline-model-parallel-size", "2"], 1,
     ["--mtp-num-layers 1 with --pipeline-model-parallel-size > 1 needs "
      "--untie-embeddings-and-output-weights"]),
    ("mtp_uniform_recompute", 1, ["--mtp-num-layers", "1", *ROPE, "--recompute-granularity",
                                  "full", "--recompute-method", "uniform",
                                  "--recompute-num-layers", "2"], 1,
     ["--mtp-num-layers 1 with --recompute-method uniform needs --recompute-num-layers 1"]),
    ("mtp_layout_without_m", 2, ["--mtp-num-layers", "1", *ROPE,
                                 "--untie-embeddings-and-output-weights",
                                 "--pipeline-model-parallel-size", "2",
                                 "--pipeline-model-parallel-layout", "Et|tL"], 1,
     ["has 0 multi-token prediction layers (m); with --mtp-num-layers 1 put 1 m right before "
      "L in the last stage"]),
]


@pytest.mark.parametrize("world,flags,status,needles", [c[1:] for c in RECIPE_FLAG_CASES],
                         ids=[c[0] for c in RECIPE_FLAG_CASES])
def test_pretrain_gpt_refuses(world, flags, status, needles, entry, gpt_data, junk, capsys):
    main = entry("pretrain_gpt_moe.py", world)
    argv = [flag.format(junk=junk) for flag in pretrain_argv(gpt_data, *flags)]
    assert_refused(main, argv, capsys, status, *(n.format(junk=junk) for n in needles))
