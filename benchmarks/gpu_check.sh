#!/usr/bin/env bash
# One script for a GPU machine (H100/H200): the gpu tests (kernels, the HBM tier's IPC with a
# second process, the engine on CUDA against transformers on every parity config, both
# connectors on CUDA caches), each op's self-check, then the figures: kernels and transfers
# (gpu_kernels) and TTFT of a ~1B model (gpu_ttft). Needs Python with a CUDA build of torch, CuPy
# and tierd's dependencies (set PYTHON to choose the interpreter). Writes gpu_check.log,
# gpu_tests.xml, gpu_kernels.json and gpu_ttft.json under benchmarks/results (or $OUT when
# set). At most about 9 minutes: each part has its own time limit (seconds, overridable:
# GPU_TESTS_S, GPU_TEST_S for one test, GPU_KERNELS_S, GPU_TTFT_S) and a hung test fails alone.
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=$(pwd)
PY=${PYTHON:-python3}
RES=$(realpath -m "${OUT:-benchmarks/results}")
mkdir -p "$RES"
LOG="$RES/gpu_check.log"
export PYTHONUNBUFFERED=1
TESTS_S=${GPU_TESTS_S:-180}
TEST_S=${GPU_TEST_S:-90}
KERNELS_S=${GPU_KERNELS_S:-120}
TTFT_S=${GPU_TTFT_S:-210}
# Run from a copy of the tests outside the checkout, so that `tierd` is the installed package
# (tierd.kernels is a package-dir mapping that a source tree on sys.path would hide).
WORK=$(mktemp -d /tmp/tierd-gpu.XXXXXX)
cp -r tests benchmarks pyproject.toml "$WORK/"
{
    echo "== gpu_check $(date -u +%FT%TZ) on $(hostname)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    if ! (cd "$WORK" && $PY -c "import tierd.kernels") 2>/dev/null; then
        $PY -m pip install -q --no-deps --no-build-isolation --target "$WORK/site" "$SRC" \
            && export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    cd "$WORK"
    $PY - <<'PY'
import torch, tierd.kernels as K
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("kernels available (CUDA and CuPy):", K.available())
PY
    echo "== gpu tests"
    timeout $TESTS_S $PY -m pytest -q -m gpu -p no:cacheprovider -o timeout=$TEST_S --junitxml="$RES/gpu_tests.xml" \
        tests/test_kernels.py tests/test_gpu_tier.py tests/test_engine.py tests/test_connector.py \
        tests/test_vllm_connector.py
    echo "pytest exit: $?"
    echo "== self-checks (kernel or reference, per op)"
    $PY -c "
import torch, tierd.kernels as K
for op in K.OPS:
    op.use_kernel(torch.device('cuda')) if torch.cuda.is_available() else None
    print(f'{op.name:30s}', op.status(torch.device('cuda')))"
    echo "== figures"
    timeout $KERNELS_S $PY -m benchmarks.gpu_kernels --json "$RES/gpu_kernels.json"
    echo "gpu_kernels exit: $?"
    TIERD_TRACE_DIR="$RES/traces" timeout $TTFT_S $PY -m benchmarks.gpu_ttft --json "$RES/gpu_ttft.json"
    echo "gpu_ttft exit: $?"
} 2>&1 | tee "$LOG"
rm -rf "$WORK"
