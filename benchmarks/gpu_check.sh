#!/usr/bin/env bash
# One script for a GPU machine (H100/H200): the gpu tests, then the kernel and transfer figures.
# Needs Python with a CUDA build of torch, CuPy and tierd's dependencies (set PYTHON to choose
# the interpreter). Writes benchmarks/results/gpu_check.log, gpu_tests.xml, gpu_kernels.json
# (or under $OUT when set). Budget: about 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RES=${OUT:-benchmarks/results}
mkdir -p "$RES"
LOG="$RES/gpu_check.log"
export PYTHONUNBUFFERED=1
{
    echo "== gpu_check $(date -u +%FT%TZ) on $(hostname)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    if ! $PY -c "import tierd.kernels" 2>/dev/null; then
        # tierd.kernels is a package-dir mapping: install (no deps, no network) beside the checkout
        $PY -m pip install -q --no-deps --no-build-isolation --target /tmp/tierd-site . \
            && export PYTHONPATH=/tmp/tierd-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    $PY - <<'PY'
import torch, tierd.kernels as K
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
print("kernels available:", K.available())
PY
    echo "== gpu tests"
    timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider --junitxml="$RES/gpu_tests.xml" tests/test_kernels.py
    echo "pytest exit: $?"
    echo "== self-checks (kernel or reference, per op)"
    $PY -c "
import torch, tierd.kernels as K
for op in K.OPS:
    op.use_kernel(torch.device('cuda')) if K.available() else None
    print(f'{op.name:24s}', op.status(torch.device('cuda')))"
    echo "== figures"
    timeout 150 $PY -m benchmarks.gpu_kernels --json "$RES/gpu_kernels.json"
    echo "gpu_kernels exit: $?"
} 2>&1 | tee "$LOG"
