#!/usr/bin/env bash
# Device check on one CUDA GPU (sized for ~10 minutes on one H200; nothing is downloaded).
# Needs torch (with CUDA) and transformers only: no vLLM, no verl, no install of this project
# (the repository is put on PYTHONPATH). Runs benchmarks/device_check.py: a random tiny Qwen3 and
# Qwen3-MoE in bf16, training forward vs incremental decode with true_on_policy.kernels, logdiff
# with the flag on/off and the on/off overhead ratio. Writes JSON to ${OUT:-.}/device_check_cuda.json.
#
#   scripts/device_check_cuda.sh
#   DEVICE=cpu PROMPTS=2 NEW_TOKENS=4 REPEATS=1 scripts/device_check_cuda.sh   # smoke test without a GPU
# Without a GPU and DEVICE=cuda it prints the environment, then stops with exit 4 and says why.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
out_dir="${OUT:-.}"
mkdir -p "${out_dir}"
out="${out_dir}/device_check_cuda.json"

"${PYTHON}" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'transformers', transformers.__version__)"

# Everything above runs on a CPU machine; the benchmark below needs the GPU it is asked for.
if [ "${DEVICE}" = "cuda" ] && ! "${PYTHON}" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "device_check_cuda.sh: stopping here: DEVICE=cuda needs a CUDA GPU and torch.cuda.is_available() is False" \
        "(DEVICE=cpu runs the same check on the CPU)" >&2
    exit 4
fi

PYTHONPATH="${repo}${PYTHONPATH:+:${PYTHONPATH}}" timeout "${TIMEOUT_S:-540}" "${PYTHON}" "${repo}/benchmarks/device_check.py" \
    --device "${DEVICE}" --dtype bfloat16 \
    --prompts "${PROMPTS:-32}" --longest "${LONGEST:-512}" --new-tokens "${NEW_TOKENS:-128}" \
    --micro-batch "${MICRO_BATCH:-5}" --repeats "${REPEATS:-5}" --json "${out}"

"${PYTHON}" - "${out}" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if r["case"].startswith("logdiff/"):
        print(f"{r['case']:28s} deterministic={r['deterministic']!s:5s} max|d|={r['max_abs_diff']:.3e} equal={r['frac_equal']:.4f} tokens={r['tokens']}")
    elif r["case"].startswith("overhead/"):
        print(f"{r['case']:40s} on={r['on_ms']:.2f} ms off={r['off_ms']:.2f} ms ratio={r['ratio']:.2f}")
    else:
        print(r)
PY
echo "wrote ${out}"
