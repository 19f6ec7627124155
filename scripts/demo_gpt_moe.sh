#!/usr/bin/env bash
# The demo `make demo` runs: a small MoE GPT (4 experts, top-2) on 4 CPU ranks with
# TP2 x EP2 x ESP2, a few hundred iterations on the bundled demo corpus, evaluation and a
# checkpoint, then a greedy continuation of a fixed prompt by the trained model, and the run's
# pictures (loss, throughput, expert load, MoE step times: --timing-log-level 2) under
# $RUN_DIR/plots. The model is Mixtral-shaped (RMSNorm, SwiGLU, RoPE, no biases). Starts fresh
# each time (the previous demo run directory is removed).
set -euo pipefail
cd "$(dirname "$0")/.."
export RUN_DIR=${RUN_DIR:-runs/demo}
rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
# the whole log in $RUN_DIR/train.log; on the terminal, without the step-time tables that
# --timing-log-level 2 prints every --log-interval (the pictures below draw them)
NPROC_PER_NODE=${NPROC:-4} TP=2 EP=2 ETP=2 TRAIN_ITERS=${TRAIN_ITERS:-300} \
    bash scripts/train_gpt_moe.sh --timing-log-level 2 "$@" 2>&1 | tee "$RUN_DIR/train.log" \
    | grep --line-buffered -v -E \
        '^(    [^ ].*\.\.+: |    moe layer [0-9]+ fwd/bwd|(\(min, max\)|max) time across ranks)'
echo "the whole training log, with the step-time tables: $RUN_DIR/train.log"
# the trained model continues a fixed prompt (greedy, one rank)
"${PYTHON:-.venv/bin/python}" tools/generate.py --load-dir "$RUN_DIR/checkpoints" \
    --prompt "${PROMPT:-Return the number of}" --max-new-tokens 24
"${PYTHON:-.venv/bin/python}" tools/plot_run.py "$RUN_DIR"
