#!/usr/bin/env bash
# Qwen3.5-35B-A3B FlashREINFORCE, true on-policy (bitwise training/rollout log-probs), on CUDA (H200 nodes):
# the project's kernels in verl's FSDP2 training and in vLLM (true_on_policy.kernels: project). Written, not run
# on a device: the launch's verdict is exit 3 (unverified rows) until a device run establishes them.
#
#   python examples/qwen35_35b_a3b/text_model.py /models/Qwen3.5-35B-A3B /models/Qwen3.5-35B-A3B-text
#   NNODES=2 MODEL_PATH=/models/Qwen3.5-35B-A3B-text TRAIN_FILES=... VAL_FILES=... \
#       examples/qwen35_35b_a3b/run_qwen35_35b_a3b.sh [--dry-run] [hydra overrides...]
#
# Environment (defaults in brackets):
#   MODEL_PATH      a local checkpoint of the text model (text_model.py makes it from the hub's vision-language
#                   checkpoint)                               [--dry-run: the shipped shapes, no weights; a launch: required]
#   NNODES          nodes in the Ray cluster                  [2]
#   NPUS_PER_NODE   GPUs per node                             [8]
#   TRAIN_FILES / VAL_FILES  parquet files                    [~/data/dapo-math-17k.parquet / ~/data/aime-2024.parquet]
#   TRAIN_BATCH_SIZE, MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH, ACTOR_LR, PROJECT_NAME, EXPERIMENT_NAME
#   PYTHON          interpreter                               [python3]
# The config (qwen35_35b_a3b_cuda.yaml, shipped as pkg://true_on_policy.configs; its comments give the layout's
# reasons) reads these with ${oc.env:...}.
#
# --dry-run prints the resolved config (YAML, with the determinism plan applied), the training/rollout contract
# table and the exact launch command, and starts nothing; it runs on a machine without accelerators. It is
# `python -m true_on_policy check`: the launch's verdict, its text on stderr and its exit code (0 accepted,
# 2 refused, 3 refused for unverified rows only; accept them by name with
# true_on_policy.accept_unverified=[...]). Off a CUDA machine it evaluates the config as declared and says so.
# Without --dry-run the script execs that launch command; verl's driver then decides with the same verdict
# before Ray starts (both: examples/run_config.sh).
set -euo pipefail

export NNODES="${NNODES:-2}" NPUS_PER_NODE="${NPUS_PER_NODE:-8}"
export TRAIN_FILES="${TRAIN_FILES:-${HOME}/data/dapo-math-17k.parquet}"
export VAL_FILES="${VAL_FILES:-${HOME}/data/aime-2024.parquet}"

if [[ " $* " == *" --dry-run "* ]]; then
    echo "# dry run: NNODES=${NNODES} NPUS_PER_NODE=${NPUS_PER_NODE} MODEL_PATH=${MODEL_PATH:-<unset: the shipped shapes, shapes/qwen35_35b_a3b>}"
elif [[ -z "${MODEL_PATH:-}" ]]; then
    echo "MODEL_PATH must name a local checkpoint of the text model (examples/qwen35_35b_a3b/text_model.py makes it)" >&2
    exit 64
fi
exec bash "$(dirname "${BASH_SOURCE[0]}")/../run_config.sh" qwen35_35b_a3b_cuda "$@"
