#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then (with --bench) the benchmark.
# Usage (repo root, after `source .device/activate.sh`):
#   [BENCH_ARGS="--quick"] bash bench/device.sh [--no-tests] [--sanitize] [--bench] [pytest args]
# Logs go to $OUT (or /tmp/dmattn-out).
set -uo pipefail
out="${OUT:-/tmp/dmattn-out}"; mkdir -p "$out"
bench=0; sanitize=0; tests=1
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench=1; shift ;;
    --sanitize) sanitize=1; shift ;;
    --no-tests) tests=0; shift ;;
    *) break ;;
  esac
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
export PYTHONUNBUFFERED=1
source bench/carried.sh
status=0
if [ "$tests" = 1 ]; then
  # -v names every test as it ends in the log (a call cut short shows which had not; the
  # slowest are listed at the end); the console keeps failures and the summary
  python3 -m pytest -m gpu -v --durations=20 -rfE -p no:cacheprovider "${jobs[@]}" "$@" 2>&1 |
    tee "$out/pytest_gpu.log" | grep -vE " (PASSED|SKIPPED|XFAIL)( |$)" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$sanitize" = 1 ]; then
  for tool in racecheck memcheck; do
    compute-sanitizer --tool "$tool" --report-api-errors no python3 -m bench.sanitize 2>&1 | tee "$out/sanitize_$tool.log" | tail -4
  done
fi
if [ "$bench" = 1 ]; then
  python3 -m bench.run --out "$out/bench" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | tail -40
fi
exit "$status"
