#!/usr/bin/env bash
# The GPU check, one short script for a GPU machine (run from anywhere; it works in the repo root):
#   1. set up: olmoflow from src/ on the machine's own python3 + CUDA torch (no network needed),
#      plus any wheels carried in .whl/ (flash_attn, say), and print what the machine has;
#   2. the 1-GPU run: benchmarks/gpu_mfu.py (olmo2_1b, bf16, flash or sdpa, eager and compiled);
#   3. the TP=2 run (torchrun, tensor_parallel=2, fsdp) when two or more GPUs are visible.
# Each run has a timeout; together they stay under the device tool's 600 s per command.
# Results: $OUT/gpu_mfu_*.log and .json (OUT defaults to runs/gpu_check, which git ignores).
# Exit status: that of the 1-GPU run (124: its timeout); the TP run's status is printed, and 3
# from it means this olmoflow has no tensor parallelism yet.
#
# Usage: bash benchmarks/gpu_check.sh [extra gpu_mfu.py arguments for both runs]
# Env:   PY (python3), TIMEOUT_1GPU (330 s), TIMEOUT_TP (210 s)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

echo "== setup"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "installing .whl/ failed"; exit 1; }
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
"$PY" - <<'EOF' || { echo "setup failed: olmoflow or CUDA torch does not import"; exit 1; }
import importlib.util, torch, olmoflow.train.trainer  # noqa: F401
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {torch.cuda.device_count()}, "
      f"flash_attn {'yes' if importlib.util.find_spec('flash_attn') else 'no'}")
assert torch.cuda.is_available(), "no CUDA GPU visible to torch"
EOF
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")

echo "== 1 GPU"
timeout "${TIMEOUT_1GPU:-330}" "$PY" benchmarks/gpu_mfu.py --json "$OUT/gpu_mfu_1gpu.json" "$@" \
    2>&1 | tee "$OUT/gpu_mfu_1gpu.log"
RC=$?
echo "1-GPU run: exit $RC"

if [ "$GPUS" -ge 2 ]; then
    echo "== TP=2 on 2 GPUs"
    timeout "${TIMEOUT_TP:-210}" "$PY" benchmarks/gpu_mfu.py --tp 2 \
        --json "$OUT/gpu_mfu_tp2.json" "$@" 2>&1 | tee "$OUT/gpu_mfu_tp2.log"
    TP_RC=$?
    case $TP_RC in
        0) echo "TP=2 run: exit 0" ;;
        3) echo "TP=2 run: tensor parallelism unavailable in this olmoflow (exit 3)" ;;
        *) echo "TP=2 run: FAILED (exit $TP_RC)" ;;
    esac
else
    echo "== TP=2 skipped: $GPUS GPU(s) visible"
fi
exit $RC
