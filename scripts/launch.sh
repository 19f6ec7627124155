#!/usr/bin/env bash
# Run a Python entry point under torchrun on this node, as one node of a multi-node job.
#
#   bash scripts/launch.sh SCRIPT [ARGS...]
#
# The job's shape comes from the environment, the same on every node except NODE_RANK:
#   NNODES (1), NODE_RANK (0), NPROC_PER_NODE (4), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500)
# MAX_RESTARTS (0): restart every rank this many times when one fails (torchrun's
# --max-restarts); give the training script --load and --save the same directory and a
# restarted job resumes from the latest checkpoint.
# torchrun numbers the ranks node by node (node r holds ranks r*NPROC_PER_NODE ...), which is
# what Megatron's group order expects: MP groups inside a node, EP and DP across nodes.
# torchrun runs through parm_trainer/cluster/torchrun_job.py: its own report of a failed job
# goes to a log file (PARM_LAUNCH_LOG, or one in $TMPDIR it names) and the job's error line
# comes last. scripts/train_gpt_moe.sh and the slurm script call this; tools/emulated_cluster.py runs it in
# every emulated node. Set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to pick the network.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ]; then
    echo "error: no script to run; usage: bash scripts/launch.sh SCRIPT [ARGS...]" >&2
    exit 2
fi
# refused here, once, rather than by every rank torchrun would start
if [[ "$1" != -* && ! -f "$1" ]]; then
    echo "error: scripts/launch.sh: no such script $1 (paths are relative to $PWD)" >&2
    exit 2
fi
for name in NNODES NODE_RANK MAX_RESTARTS MASTER_PORT; do
    whole='^[0-9]+$'
    if [ "$name" = NNODES ]; then whole='^[0-9]+(:[0-9]+)?$'; fi  # torchrun's MIN:MAX
    if [ -n "${!name:-}" ] && ! [[ "${!name}" =~ $whole ]]; then
        echo "error: $name=${!name} must be a whole number" >&2
        exit 2
    fi
done
# the project's environment (make setup) when there is one
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi

# Several nodes and no interface named: gloo binds to the interface holding the address this
# node reaches the master from (NCCL picks its own). Names such as a slurm node's resolve first.
if [ "${NNODES:-1}" != 1 ] && [ -z "${GLOO_SOCKET_IFNAME:-}" ] && command -v ip >/dev/null; then
    master_ip=$(getent ahostsv4 "${MASTER_ADDR:-127.0.0.1}" | awk 'NR == 1 {print $1}') || true
    src=$(ip -o route get "${master_ip:-127.0.0.1}" 2>/dev/null | grep -o 'src [0-9.]*' | cut -d' ' -f2) || true
    dev=$(ip -o -4 addr show 2>/dev/null | awk -v a="$src" 'index($4, a "/") == 1 {print $2; exit}') || true
    if [ -n "$dev" ]; then export GLOO_SOCKET_IFNAME=$dev; fi
fi

exec "$PYTHON" -m parm_trainer.cluster.torchrun_job \
    --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --nproc-per-node "${NPROC_PER_NODE:-4}" --max-restarts "${MAX_RESTARTS:-0}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    "$@"
