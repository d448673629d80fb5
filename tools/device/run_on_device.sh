#!/usr/bin/env bash
# The one command on the device machine (see tools/device/README.md): installs the carried wheels into
# /tmp/site, records the GPU, runs the GPU check into $OUT (the device tool's output folder) with its log.
# BUDGET_S (default 400) is the check's own time budget; the command ends within it plus ~1 minute.
# SECTIONS (default: all) is passed as --sections, e.g. SECTIONS=graphed_step,speedups for a rerun.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    tools/device/wheels/*.whl || { echo "wheel install failed: run tools/device/prepare.sh and carry tools/device/wheels"; exit 3; }
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/nvidia-smi.csv" 2>&1 || true
python3 -c "import pydantic, torch, transformers; print('pydantic', pydantic.VERSION, 'torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.is_available(), 'transformers', transformers.__version__)"
timeout $(( ${BUDGET_S:-400} + 90 )) python3 -m tools.gpu_check --out "$out" --device cuda --budget-s "${BUDGET_S:-400}" \
    ${SECTIONS:+--sections "$SECTIONS"} \
    2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
echo "gpu_check exit status $status (0: greedy equality held in every case; 1: a case diverged or failed; 124: timed out)"
exit "$status"
