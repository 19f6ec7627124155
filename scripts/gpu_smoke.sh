#!/usr/bin/env bash
# The GPU check: under 5 minutes on one machine with NVIDIA GPUs (NCCL collectives against
# gloo, the MoE schedules against the reference in fp32 and bf16, again with grouped-GEMM
# experts (Transformer Engine's where installed), a timed layer table and a short bf16
# pretrain), one summary table at the end; tools/gpu_smoke.py says what each stage
# checks and its tolerances. --dry-run runs it all on CPU (the test suite does).
#
#   make setup data && bash scripts/gpu_smoke.sh            # on the GPU machine
#   bash scripts/gpu_smoke.sh --dry-run                     # anywhere
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
exec "$PYTHON" tools/gpu_smoke.py "$@"
