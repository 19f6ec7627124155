#!/usr/bin/env bash
# Launch pretrain_bert_moe.py (MoE BERT: masked LM + sentence order) with torchrun, on one node
# or several.
#
#   One node:     NPROC_PER_NODE=8 TP=2 EP=4 bash scripts/train_bert_moe.sh [extra flags]
#   Many nodes:   on every node, with the same MASTER_ADDR/MASTER_PORT and its own NODE_RANK:
#                 NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 NPROC_PER_NODE=8 bash scripts/train_bert_moe.sh
#   Masked LM only: bash scripts/train_bert_moe.sh --bert-no-binary-head
#
# The launcher is scripts/train_gpt_moe.sh with the BERT entry point and data: every setting
# documented there (TP, EP, ETP, PP, NUM_EXPERTS, TOPK, NUM_LAYERS, HIDDEN, HEADS, SEQ, MOE_FFN,
# MBS, GBS, TRAIN_ITERS, LR, WARMUP, SEED, RUN_DIR, ...) works the same. DATA_PATH must be a
# sentence-level dataset (tools/preprocess_data.py --split-sentences, PREFIX_text_sentence).
# Extra arguments are passed on to pretrain_bert_moe.py last, so they win.
set -euo pipefail
export PRETRAIN=pretrain_bert_moe.py
export DATA_PATH=${DATA_PATH:-data/demo/corpus_text_sentence}
export RUN_DIR=${RUN_DIR:-runs/bert_moe}
export WANDB_EXP_NAME=${WANDB_EXP_NAME:-bert_moe}
exec bash "$(dirname "$0")/train_gpt_moe.sh" "$@"
