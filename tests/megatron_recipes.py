"""Megatron-LM's published training recipes, their argument arrays held as data.

Each array is copied as published in NVIDIA/Megatron-LM at tag core_v0.16.1 (the release of the
megatron-core this project runs on); `$NAME` stands for the script's own shell variables. A
test may change the values of the sizes (model, batch, iterations, intervals), the paths and
the parallel sizes the GPU count sets, and nothing else: `argv` refuses a change to a flag the
recipe does not have, and keeps every flag the recipe has.
"""

from __future__ import annotations

from typing import NamedTuple


class Recipe(NamedTuple):
    source: str
    arrays: dict  # array name -> the words, as published


MIXTRAL_8X7B = Recipe(
    "NVIDIA/Megatron-LM core_v0.16.1 examples/mixtral/train_mixtral_8x7b_distributed.sh",
    {
        "MODEL_ARGS": [
            "--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096",
            "--max-position-embeddings", "32768", "--num-layers", "32", "--hidden-size", "4096",
            "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--init-method-std",
            "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization",
            "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
            "--untie-embeddings-and-output-weights", "--group-query-attention",
            "--num-query-groups", "8", "--no-masked-softmax-fusion", "--no-position-embedding",
            "--rotary-base", "1000000"],
        "MOE_ARGS": [
            "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
            "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
            "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather",
            "--overlap-grad-reduce"],
        "DATA_ARGS": [
            "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "$TOKENIZER_MODEL",
            "--data-path", "$DATA_PATH", "--split", "99990,8,2"],
        "TRAINING_ARGS": [
            "--micro-batch-size", "1", "--global-batch-size", "256", "--lr", "1e-4",
            "--train-iters", "500000", "--lr-decay-iters", "320000", "--lr-decay-style",
            "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1", "--lr-warmup-iters", "500",
            "--clip-grad", "1.0", "--bf16"],
        "MODEL_PARALLEL_ARGS": [
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
            "--expert-model-parallel-size", "8", "--use-distributed-optimizer",
            "--sequence-parallel"],
        "LOGGING_ARGS": [
            "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
            "--eval-iters", "10", "--save", "$CHECKPOINT_PATH", "--load", "$CHECKPOINT_PATH",
            "--tensorboard-dir", "$CHECKPOINT_PATH/tensorboard", "--no-load-optim",
            "--no-load-rng"],
    })

GPT3_175B = Recipe(
    "NVIDIA/Megatron-LM core_v0.16.1 examples/gpt3/train_gpt3_175b_distributed.sh",
    {
        "GPT_MODEL_ARGS": [
            "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend",
            "auto"],
        "TRAINING_ARGS": [
            "--micro-batch-size", "1", "--global-batch-size", "1536", "--rampup-batch-size",
            "16", "16", "5859375", "--train-iters", "500000", "--weight-decay", "0.1",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
            "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
            "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000"],
        "MODEL_PARALLEL_ARGS": [
            "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16"],
        "DATA_ARGS": [
            "--data-path", "$DATA_PATH", "--vocab-file", "$VOCAB_FILE", "--merge-file",
            "$MERGE_FILE", "--split", "949,50,1"],
        "EVAL_AND_LOGGING_ARGS": [
            "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
            "--save", "$CHECKPOINT_PATH", "--load", "$CHECKPOINT_PATH", "--eval-iters", "10",
            "--tensorboard-dir", "$TENSORBOARD_LOGS_PATH"],
    })

# the example at the end of megatron/core/transformer/moe/README.md (Mixtral 8x7B, 32 GPUs)
MOE_README_MIXTRAL = Recipe(
    "NVIDIA/Megatron-LM core_v0.16.1 megatron/core/transformer/moe/README.md, Examples",
    {
        "MODEL_ARGS": [
            "--disable-bias-linear", "--seq-length", "4096", "--max-position-embeddings",
            "32768", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size",
            "14336", "--num-attention-heads", "32", "--init-method-std", "0.01",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization",
            "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
            "--untie-embeddings-and-output-weights", "--group-query-attention",
            "--num-query-groups", "8", "--no-masked-softmax-fusion", "--no-position-embedding"],
        "MOE_ARGS": [
            "--num-experts", "8", "--expert-model-parallel-size", "8",
            "--moe-router-load-balancing-type", "aux_loss", "--moe-router-topk", "2",
            "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-permute-fusion",
            "--moe-token-dispatcher-type", "alltoall"],
        "DATA_ARGS": [
            "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "$TOKENIZER_MODEL",
            "--data-path", "$DATA_PATH", "--split", "99990,8,2"],
        "TRAINING_ARGS": [
            "--micro-batch-size", "1", "--global-batch-size", "128", "--lr", "1e-4",
            "--train-iters", "500000", "--lr-decay-iters", "320000", "--lr-decay-style",
            "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1", "--lr-warmup-iters", "500",
            "--clip-grad", "1.0", "--bf16", "--overlap-grad-reduce", "--overlap-param-gather"],
        "MODEL_PARALLEL_ARGS": [
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
            "--num-layers-per-virtual-pipeline-stage", "8", "--sequence-parallel",
            "--use-distributed-optimizer"],
        "LOGGING_ARGS": [
            "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
            "--eval-iters", "10", "--save", "$CHECKPOINT_PATH", "--load", "$CHECKPOINT_PATH",
            "--tensorboard-dir", "$CHECKPOINT_PATH/tensorboard", "--ckpt-format", "torch_dist",
            "--auto-detect-ckpt-format"],
    })

# examples/mixtral/README.md: a Hugging Face Mixtral converted for training
MIXTRAL_CONVERT = [
    "--model-type", "GPT", "--loader", "loader_mixtral_hf", "--saver", "mcore",
    "--target-tensor-parallel-size", "$TARGET_TP_SIZE", "--target-pipeline-parallel-size",
    "$TARGET_PP_SIZE", "--target-expert-parallel-size", "$TARGET_EP_SIZE", "--load-dir",
    "$HF_FORMAT_DIR", "--save-dir", "$MEGATRON_FORMAT_DIR", "--tokenizer-model",
    "$TOKENIZER_MODEL"]

# the flag lists of the MoE README's "General Performance Tips" (written there as a block)
MOE_README_TIPS = [
    "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep",
    "--moe-grouped-gemm", "--moe-router-fusion", "--moe-permute-fusion",
    "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te",
    "--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce",
    "--tp-comm-overlap", "--manual-gc", "--manual-gc-interval", "10"]


def words(recipe: Recipe) -> list:
    """The recipe's command line as torchrun hands it to the training script."""
    return [word for array in recipe.arrays.values() for word in array]


def flags(argv: list) -> list:
    return [word for word in argv if word.startswith("--")]


def with_variables(words: list, variables: dict) -> list:
    for name, value in variables.items():
        words = [word.replace(f"${name}", str(value)) for word in words]
    return words


def argv(recipe: Recipe, values: dict, variables: dict) -> list:
    """The recipe's words with the values of some flags changed and its $VARIABLES set.
    values: flag -> its new value (a string, or a list for a flag of several values)."""
    published = words(recipe)
    unknown = set(values) - set(flags(published))
    assert not unknown, f"{recipe.source} has no {sorted(unknown)}"
    out, i = [], 0
    while i < len(published):
        word = published[i]
        out.append(word)
        i += 1
        if word in values:
            new = values[word]
            new = new if isinstance(new, list) else [new]
            out.extend(str(v) for v in new)
            while i < len(published) and not published[i].startswith("--"):
                i += 1  # the published value(s), replaced
    out = with_variables(out, variables)
    assert flags(out) == flags(published)
    return out
