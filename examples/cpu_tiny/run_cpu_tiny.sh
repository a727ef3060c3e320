#!/usr/bin/env bash
# FlashREINFORCE, true on-policy, on CPU: verl's real PPO trainer with the project's CPU backend.
#
#   examples/cpu_tiny/run_cpu_tiny.sh [--dry-run] [CONFIG] [hydra overrides...]
#
# CONFIG is any CPU config shipped in the package (pkg://true_on_policy.configs: cpu_tiny, cpu_tiny_moe,
# cpu_tiny_async, cpu_tiny_vllm, ...; default cpu_tiny). Builds the offline tiny assets if missing
# (under $TRUE_ON_POLICY_ASSETS, default ~/.cache/true_on_policy), then launches exactly what a verl
# user would type. --dry-run prints the launch's verdict (`python -m true_on_policy check`: its text,
# its exit code) and the exact launch command, and starts nothing.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
config_path="pkg://true_on_policy.configs"
dry_run=0
if [[ $# -gt 0 && "$1" == --dry-run ]]; then dry_run=1; shift; fi
config="cpu_tiny"
if [[ $# -gt 0 && "$1" != *=* ]]; then config="$1"; shift; fi
"${PYTHON}" -m true_on_policy build-assets >&2
check=("${PYTHON}" -m true_on_policy check --config-path "${config_path}" --config-name "${config}" --python "${PYTHON}")
if [[ "${dry_run}" == 1 ]]; then
    exec "${check[@]}" --show-command -- "$@"
fi
command=()
while IFS= read -r -d '' part; do
    command+=("${part}")
done < <("${check[@]}" --command-args -- "$@")
if [[ ${#command[@]} == 0 ]]; then
    echo "could not build the launch command (see the error above)" >&2
    exit 1
fi
echo "+ ${command[*]}" >&2
exec "${command[@]}"
