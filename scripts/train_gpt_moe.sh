#!/usr/bin/env bash
# Launch pretrain_gpt_moe.py with torchrun, on one node or several.
#
#   One node:     NPROC_PER_NODE=8 TP=2 EP=4 bash scripts/train_gpt_moe.sh [extra flags]
#   Many nodes:   on every node, with the same MASTER_ADDR/MASTER_PORT and its own NODE_RANK:
#                 NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 NPROC_PER_NODE=8 bash scripts/train_gpt_moe.sh
#
# Every setting below can be overridden from the environment; extra arguments are passed on
# to pretrain_gpt_moe.py last, so they win over the defaults here. PRETRAIN names the entry
# script: scripts/train_bert_moe.sh runs this launcher with PRETRAIN=pretrain_bert_moe.py.
set -euo pipefail
cd "$(dirname "$0")/.."

PRETRAIN=${PRETRAIN:-pretrain_gpt_moe.py}
# torchrun's settings (NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT, PYTHON) are
# read by scripts/launch.sh, the multi-node launcher.

TP=${TP:-2}; EP=${EP:-2}; ETP=${ETP:-$TP}; PP=${PP:-1}
NUM_EXPERTS=${NUM_EXPERTS:-4}; TOPK=${TOPK:-2}
for name in TP EP ETP PP NUM_EXPERTS TOPK; do  # TP is compared below; all are flag values
    if ! [[ "${!name}" =~ ^[1-9][0-9]*$ ]]; then
        echo "error: $name=${!name} must be a positive whole number" >&2
        exit 2
    fi
done
DATA_PATH=${DATA_PATH:-data/demo/corpus_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-data/demo/tokenizer.model}
RUN_DIR=${RUN_DIR:-runs/gpt_moe}

MODEL_ARGS=(
    --num-layers "${NUM_LAYERS:-4}" --hidden-size "${HIDDEN:-128}"
    --num-attention-heads "${HEADS:-4}" --seq-length "${SEQ:-128}"
    --max-position-embeddings "${SEQ:-128}" --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0
)
# ARCH=mixtral (GPT's default): RMSNorm, SwiGLU, RoPE, as Mixtral (it exports to Hugging Face);
# ARCH=gpt2 (BERT's default): LayerNorm, GELU, learned positions
ARCH=${ARCH:-$([ "$PRETRAIN" = pretrain_gpt_moe.py ] && echo mixtral || echo gpt2)}
if [ "$ARCH" = mixtral ]; then
    MODEL_ARGS+=(--normalization RMSNorm --swiglu --position-embedding-type rope)
fi
MOE_ARGS=(
    --num-experts "$NUM_EXPERTS" --moe-router-topk "$TOPK"
    --moe-ffn-hidden-size "${MOE_FFN:-256}" --moe-aux-loss-coeff 0.01
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --expert-model-parallel-size "$EP"
    --expert-tensor-parallel-size "$ETP" --pipeline-model-parallel-size "$PP"
)
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
# TRAIN_SAMPLES: train for that many samples (Megatron-LM's sample-based schedule, warmup over
# WARMUP_FRACTION of it) instead of TRAIN_ITERS iterations with WARMUP iterations of warmup
if [ -n "${TRAIN_SAMPLES:-}" ]; then
    LENGTH_ARGS=(--train-samples "$TRAIN_SAMPLES" --lr-warmup-fraction "${WARMUP_FRACTION:-0.1}")
else
    LENGTH_ARGS=(--train-iters "${TRAIN_ITERS:-300}" --lr-warmup-iters "${WARMUP:-30}")
fi
TRAINING_ARGS=(
    --micro-batch-size "${MBS:-4}" --global-batch-size "${GBS:-16}" "${LENGTH_ARGS[@]}"
    --lr "${LR:-1.5e-3}" --min-lr "${MIN_LR:-1.5e-4}" --lr-decay-style cosine --clip-grad 1.0
    --weight-decay 0.1 --seed "${SEED:-1234}"
)
# data-parallel gradients reduced during the backward (as Megatron-LM's example recipes do);
# OVERLAP_GRAD_REDUCE=0: after it
if [ "${OVERLAP_GRAD_REDUCE:-1}" = 1 ]; then TRAINING_ARGS+=(--overlap-grad-reduce); fi
# micro-batches in pairs, one computing while the other's MoE exchange travels;
# OVERLAP_MOE_COMM=0: one at a time
if [ "${OVERLAP_MOE_COMM:-1}" = 1 ]; then
    TRAINING_ARGS+=(--overlap-moe-expert-parallel-comm)
fi
# no --tokenizer-type: SentencePiece from TOKENIZER_MODEL, unless --vocab-file and --merge-file
# are appended (GPT-2 BPE, as Megatron-LM's GPT-3 recipe) or another type is
DATA_ARGS=(
    --data-path $DATA_PATH --split "${SPLIT:-969,30,1}"
    --tokenizer-model "$TOKENIZER_MODEL"
    --data-cache-path "$RUN_DIR/data_cache"
)
OUTPUT_ARGS=(
    --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-100}"
    --eval-iters "${EVAL_ITERS:-10}" --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints"
    --save-interval "${SAVE_INTERVAL:-1000}" --tensorboard-dir "$RUN_DIR/tensorboard"
)
if [ -n "${WANDB_PROJECT:-}" ]; then
    OUTPUT_ARGS+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "${WANDB_EXP_NAME:-gpt_moe}")
fi

# LAYOUT=auto: tools/plan_layout.py picks TP, EP, ESP, PP, the virtual stages and the stages for
# NNODES x NPROC_PER_NODE ranks from the cost model (PROFILE: a calibrate_comm.py profile, else
# the built-in default), in place of TP, EP, ETP and PP; every node computes the same choice.
# LAYOUT=<megatron layout string, e.g. Ettt|ttL>: those stages under PP.
if [ "${LAYOUT:-}" = auto ]; then
    if [ -z "${PYTHON:-}" ]; then
        if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
    fi
    planned=$("$PYTHON" tools/plan_layout.py --nodes "${NNODES:-1}" \
        --gpus-per-node "${NPROC_PER_NODE:-4}" --flags-only ${PROFILE:+--profile "$PROFILE"} \
        -- "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" \
        --tokenizer-model "$TOKENIZER_MODEL" "$@")
    read -r -a PARALLEL_ARGS <<< "$planned"
    echo "LAYOUT=auto: ${PARALLEL_ARGS[*]}"
elif [ -n "${LAYOUT:-}" ]; then
    PARALLEL_ARGS+=(--pipeline-model-parallel-layout "$LAYOUT")
fi

exec bash scripts/launch.sh "$PRETRAIN" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
