#!/usr/bin/env bash
# Install the Ascend stack configs/qwen3_30b_a3b_ascend.yaml is written for (docs/stacks.md, "Ascend").
# Needs CANN 9.0.0 sourced (set_env.sh) and an Atlas A2/A3 machine; not run by this project (no NPU).
#
#   scripts/install_ascend.sh            install into the active Python environment
#   scripts/install_ascend.sh --dry-run  print the commands only
#
# Build-time switches: vllm-ascend builds its AscendC batch_invariant_ops (package ops-batchinvariant)
# only when VLLM_BATCH_INVARIANT=1 is set while it builds (csrc/build_aclnn.sh ->
# build_batch_invariant_ops.sh, vllm-ascend PR #10034, from v0.21.0rc1), with its custom kernels
# compiled (COMPILE_CUSTOM_KERNELS=1: the default on main, asked for by the rl_config guide of PR
# #13712; set here so a 0 left in the environment cannot skip them). A failed download there is only
# logged, and the rollout would then fall back to Triton mm/softmax; so the last step imports
# batch_invariant_ops and fails naming the package.
set -euo pipefail

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
WORK=${WORK:-$HOME/ascend_src}
VLLM_TAG=v0.27.1            # the vLLM tag vllm-ascend main's Dockerfile builds against
VLLM_ASCEND_REF=182b75ea8   # a main build at/after 2c72a26f35 (rl_config)
MINDSPEED_BRANCH=core_r0.16.0
MEGATRON_REF=core_r0.16.0

run() {
    echo "+ $*"
    [ "$DRY" = 1 ] || eval "$@"
}

if [ "$DRY" = 0 ] && [ -z "${ASCEND_HOME_PATH:-${ASCEND_TOOLKIT_HOME:-}}" ]; then
    echo "install_ascend.sh: CANN is not in the environment (ASCEND_HOME_PATH unset): source <CANN>/set_env.sh first" >&2
    exit 2
fi

run "mkdir -p '$WORK'"
run "pip install torch==2.10.0 torch-npu==2.10.0.post4"
run "git clone -b $VLLM_TAG https://github.com/vllm-project/vllm '$WORK/vllm'"
run "VLLM_TARGET_DEVICE=empty pip install -e '$WORK/vllm'"
run "git clone https://github.com/vllm-project/vllm-ascend '$WORK/vllm-ascend'"
run "git -C '$WORK/vllm-ascend' checkout $VLLM_ASCEND_REF"
run "VLLM_BATCH_INVARIANT=1 COMPILE_CUSTOM_KERNELS=1 pip install -e '$WORK/vllm-ascend'"
run "git clone -b $MINDSPEED_BRANCH https://gitcode.com/Ascend/MindSpeed.git '$WORK/MindSpeed'"
run "pip install -e '$WORK/MindSpeed'"
run "pip install 'git+https://github.com/NVIDIA/Megatron-LM.git@$MEGATRON_REF'"
run "pip install -e ."
# no silent Triton fallback: the ops package must import (the plan refuses the launch otherwise)
run "python -c 'import batch_invariant_ops' || { echo 'install_ascend.sh: batch_invariant_ops (package ops-batchinvariant) did not build: rebuild vllm-ascend with VLLM_BATCH_INVARIANT=1 COMPILE_CUSTOM_KERNELS=1 and read its build log' >&2; exit 3; }"
