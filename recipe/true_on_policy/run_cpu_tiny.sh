#!/usr/bin/env bash
# FlashREINFORCE, true on-policy, on CPU: verl's real PPO trainer with the project's CPU backend.
#
#   recipe/true_on_policy/run_cpu_tiny.sh [--dry-run] [CONFIG] [hydra overrides...]
#
# CONFIG is any CPU config in configs/ (cpu_tiny, cpu_tiny_moe, cpu_tiny_async, cpu_tiny_vllm, ...;
# default cpu_tiny). Builds the offline tiny assets if missing (under $TRUE_ON_POLICY_ASSETS,
# default ~/.cache/true_on_policy), then launches exactly what a verl user would type.
# --dry-run prints the launch's verdict (`python -m true_on_policy check`) and starts nothing.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
dry_run=0
if [[ $# -gt 0 && "$1" == --dry-run ]]; then dry_run=1; shift; fi
config="cpu_tiny"
if [[ $# -gt 0 && "$1" != *=* ]]; then config="$1"; shift; fi
"${PYTHON}" -m true_on_policy build-assets >&2
if [[ "${dry_run}" == 1 ]]; then
    exec "${PYTHON}" -m true_on_policy check --config-path "${repo}/configs" --config-name "${config}" -- "$@"
fi
exec "${PYTHON}" -m verl.trainer.main_ppo --config-path="${repo}/configs" --config-name="${config}" "$@"
