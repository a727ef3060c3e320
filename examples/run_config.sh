#!/usr/bin/env bash
# One shipped config through verl, as the device run scripts (qwen3_30b_a3b/, qwen35_35b_a3b/) launch it:
#
#   examples/run_config.sh CONFIG_NAME [--dry-run] [hydra overrides...]
#
# --dry-run prints the resolved config (YAML, with the determinism plan applied), the training/rollout contract
# table and the exact launch command, and starts nothing: it is `python -m true_on_policy check`, the launch's
# verdict (its text on stderr, its exit code: 0 accepted, 2 refused, 3 refused for unverified rows only). Without
# it the script execs that launch command; verl's driver then decides with the same verdict before Ray starts.
# PYTHON: the interpreter [python3].
set -euo pipefail

PYTHON="${PYTHON:-python3}"
config_path="pkg://true_on_policy.configs"
config_name="$1"
shift
dry_run=0
overrides=()
for arg in "$@"; do
    case "${arg}" in
        --dry-run) dry_run=1 ;;
        *) overrides+=("${arg}") ;;
    esac
done

if [[ "${dry_run}" == 1 ]]; then
    exec "${PYTHON}" -m true_on_policy check --config-path "${config_path}" --config-name "${config_name}" \
        --python "${PYTHON}" --show-config --plan --show-command -- "${overrides[@]+"${overrides[@]}"}"
fi

command=()
while IFS= read -r -d '' part; do
    command+=("${part}")
done < <("${PYTHON}" -m true_on_policy check --config-path "${config_path}" --config-name "${config_name}" \
    --python "${PYTHON}" --command-args -- "${overrides[@]+"${overrides[@]}"}")
if [[ ${#command[@]} == 0 ]]; then
    echo "could not build the launch command (see the error above)" >&2
    exit 1
fi
echo "+ ${command[*]}" >&2
exec "${command[@]}"
