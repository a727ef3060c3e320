#!/usr/bin/env bash
# FlashREINFORCE, true on-policy, on CPU: verl's real PPO trainer with the project's CPU backend.
#
#   examples/run_cpu_tiny.sh [cpu_tiny|cpu_tiny_moe|cpu_tiny_async] [hydra overrides...]
#
# Builds the offline tiny assets if missing (under $TRUE_ON_POLICY_ASSETS, default
# ~/.cache/true_on_policy), then launches exactly what a verl user would type.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
config="cpu_tiny"
if [[ $# -gt 0 && "$1" != *=* ]]; then config="$1"; shift; fi
"${PYTHON}" -m true_on_policy build-assets
exec "${PYTHON}" -m verl.trainer.main_ppo --config-path="${repo}/configs" --config-name="${config}" "$@"
