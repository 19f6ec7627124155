#!/usr/bin/env bash
# The demo `make demo-bert` runs: a small MoE BERT (4 experts, top-2, masked LM + sentence
# order) on 4 CPU ranks with TP2 x EP2 x ESP2 and --moe-parm-schedule auto, a few hundred
# iterations on the sentence-level demo corpus, evaluation and a checkpoint, and the run's
# pictures under $RUN_DIR/plots. Starts fresh each time (the previous demo run directory is
# removed).
set -euo pipefail
cd "$(dirname "$0")/.."
export RUN_DIR=${RUN_DIR:-runs/demo_bert}
rm -rf "$RUN_DIR"
NPROC_PER_NODE=${NPROC:-4} TP=2 EP=2 ETP=2 TRAIN_ITERS=${TRAIN_ITERS:-300} \
    bash scripts/train_bert_moe.sh --moe-parm-schedule auto --timing-log-level 2 "$@"
"${PYTHON:-.venv/bin/python}" tools/plot_run.py "$RUN_DIR"
