#!/usr/bin/env bash
# Qwen3-30B-A3B FlashREINFORCE, true on-policy (bitwise training/rollout log-probs), on Ascend or CUDA.
#
#   PLATFORM=ascend NNODES=2 MODEL_PATH=/models/Qwen3-30B-A3B TRAIN_FILES=... VAL_FILES=... \
#       examples/qwen3_30b_a3b/run_qwen3_30b_a3b.sh [--dry-run] [hydra overrides...]
#
# Environment (defaults in brackets):
#   PLATFORM        ascend | cuda                                        [ascend]
#   NNODES          nodes in the Ray cluster                             [ascend 1, cuda 2]
#   NPUS_PER_NODE   accelerators per node (NPUs on Ascend, GPUs on CUDA) [ascend 16, cuda 8]
#   MODEL_PATH      Hugging Face model directory or id                   [Qwen/Qwen3-30B-A3B]
#   TRAIN_FILES / VAL_FILES  parquet files                               [~/data/dapo-math-17k.parquet / ~/data/aime-2024.parquet]
#   TRAIN_BATCH_SIZE, MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH, ACTOR_LR, PROJECT_NAME, EXPERIMENT_NAME
#   PYTHON          interpreter                                          [python3]
# The configs (qwen3_30b_a3b_<platform>.yaml, shipped as pkg://true_on_policy.configs) read these
# with ${oc.env:...}.
#
# --dry-run prints the resolved config (YAML, with the determinism plan applied), the
# training/rollout contract table and the exact launch command, and starts nothing; it runs on a
# machine without accelerators. It is `python -m true_on_policy check`: the launch's verdict, its
# text on stderr and its exit code (0 accepted, 2 refused, 3 refused for unverified rows only). On a
# machine that is not the config's platform it evaluates the config as declared and says so; the
# launch there refuses. Without --dry-run the script execs that launch command; verl's driver then
# decides with the same verdict before Ray starts (both: examples/run_config.sh).
set -euo pipefail

PLATFORM="${PLATFORM:-ascend}"

case "${PLATFORM}" in
    ascend) export NNODES="${NNODES:-1}" NPUS_PER_NODE="${NPUS_PER_NODE:-16}" ;;
    cuda) export NNODES="${NNODES:-2}" NPUS_PER_NODE="${NPUS_PER_NODE:-8}" ;;
    *) echo "PLATFORM must be ascend or cuda, got '${PLATFORM}'" >&2; exit 64 ;;
esac
export MODEL_PATH="${MODEL_PATH:-Qwen/Qwen3-30B-A3B}"
export TRAIN_FILES="${TRAIN_FILES:-${HOME}/data/dapo-math-17k.parquet}"
export VAL_FILES="${VAL_FILES:-${HOME}/data/aime-2024.parquet}"

if [[ " $* " == *" --dry-run "* ]]; then
    echo "# dry run: PLATFORM=${PLATFORM} NNODES=${NNODES} NPUS_PER_NODE=${NPUS_PER_NODE} MODEL_PATH=${MODEL_PATH}"
fi
exec bash "$(dirname "${BASH_SOURCE[0]}")/../run_config.sh" "qwen3_30b_a3b_${PLATFORM}" "$@"
