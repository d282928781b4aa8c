#!/usr/bin/env bash
# One script for a GPU machine (H100/H200): the gpu tests (kernels, the HBM tier's IPC with a
# second process, the engine on CUDA against transformers on every parity config, both
# connectors on CUDA caches), each op's self-check, then the figures: kernels and transfers
# (gpu_kernels) and TTFT of a ~1B model (gpu_ttft). Needs Python with a CUDA build of torch, CuPy
# and tierd's dependencies (set PYTHON to choose the interpreter). Writes gpu_check.log,
# gpu_tests.xml, gpu_kernels.json and gpu_ttft.json under benchmarks/results (or $OUT when
# set). At most 6 minutes on an H100, so that a 15-minute loan holds a run and a rerun: each part
# has its own time limit (seconds, overridable: GPU_TESTS_S, GPU_TEST_S for one test,
# GPU_KERNELS_S, GPU_TTFT_S) and writes its figures as it measures them (a part stopped by its
# limit loses only what it had not measured); profiler traces come last. Exits non-zero when a
# test, a part or a goal failed; ends with one screen of every figure against its goal
# (benchmarks/gpu_summary.py).
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=$(pwd)
PY=${PYTHON:-python3}
RES=$(realpath -m "${OUT:-benchmarks/results}")
mkdir -p "$RES"
LOG="$RES/gpu_check.log"
export PYTHONUNBUFFERED=1
TESTS_S=${GPU_TESTS_S:-110}
TEST_S=${GPU_TEST_S:-60}
KERNELS_S=${GPU_KERNELS_S:-60}
TTFT_S=${GPU_TTFT_S:-150}
FAILED=0
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
    rc=$?; echo "pytest exit: $rc"; [ $rc -eq 0 ] || FAILED=1
    echo "== self-checks (kernel or reference, per op)"
    timeout 30 $PY -c "
import torch, tierd.kernels as K
for op in K.OPS:
    op.use_kernel(torch.device('cuda')) if torch.cuda.is_available() else None
    print(f'{op.name:30s}', op.status(torch.device('cuda')))"
    echo "== figures"
    timeout $KERNELS_S $PY -m benchmarks.gpu_kernels --json "$RES/gpu_kernels.json"
    rc=$?; echo "gpu_kernels exit: $rc"; [ $rc -eq 0 ] || FAILED=1
    TIERD_TRACE_DIR="$RES/traces" timeout $TTFT_S $PY -m benchmarks.gpu_ttft --json "$RES/gpu_ttft.json"
    rc=$?; echo "gpu_ttft exit: $rc"; [ $rc -eq 0 ] || FAILED=1
    echo "== summary"
    $PY -m benchmarks.gpu_summary "$RES" || FAILED=1
    echo "gpu_check: $([ $FAILED -eq 0 ] && echo "all parts passed" || echo "a test, part or goal FAILED")"
    exit $FAILED
} 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$status"
