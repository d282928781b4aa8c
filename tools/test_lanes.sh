#!/usr/bin/env bash
# The whole test suite in two lanes side by side (what `make test` runs): the tests that run
# real vLLM and SGLang engines in one, everything else in the other. An engine test spends
# most of its time in engine processes bound to one core each, the rest mostly in one Python
# process, so on two cores the lanes take ~2/3 of the time one after the other would.
#
#   tools/test_lanes.sh PYTHON [PYTEST ARGS...]
#
# The engine lane's output is kept in a file and shown when both lanes are done; the exit
# status is non-zero when either lane failed.
set -uo pipefail
py=$1
shift
engines=(tests/test_vllm_models.py tests/test_vllm_engine.py tests/test_sglang.py tests/test_vllm_decide.py
         tests/test_benchmarks.py)
ignore=()
for f in "${engines[@]}"; do ignore+=("--ignore=$f"); done

log=$(mktemp "${TMPDIR:-/tmp}/tierd-engine-lane-XXXXXX")
trap 'rm -f "$log"' EXIT
start=$(date +%s)
"$py" -m pytest "$@" "${engines[@]}" > "$log" 2>&1 &
lane=$!
"$py" -m pytest "$@" "${ignore[@]}"
rest=$?
rest_s=$(( $(date +%s) - start ))
wait "$lane"
eng=$?
echo
echo "==== the engine lane (${engines[*]}) ===="
cat "$log"
echo "==== lanes: the rest exited $rest after ${rest_s} s, the engines exited $eng after $(( $(date +%s) - start )) s ===="
[ "$rest" -eq 0 ] && [ "$eng" -eq 0 ]
