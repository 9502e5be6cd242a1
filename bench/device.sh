#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then (with --bench) the benchmark.
# Usage (repo root, after `source .device/activate.sh`):
#   [BENCH_ARGS="--quick"] bash bench/device.sh [--part 1|2] [--no-tests] [--sanitize] [--bench] \
#       [pytest args]
# --part: half of the GPU test files, for calls too short for the whole suite (H200, 12
# workers, 2026-11-28: part 1 in 297 s, part 2 in 275 s); the two parts together are every
# file.
# Logs go to $OUT (or /tmp/dmattn-out).
set -uo pipefail
out="${OUT:-/tmp/dmattn-out}"; mkdir -p "$out"
bench=0; sanitize=0; tests=1; files=()
# part 1 starts with the disk-cache tests, which precompile whole families before their checks
part1=(tests/test_cache_gpu.py tests/test_mma_sync_on_hopper_gpu.py tests/test_bwd*_gpu.py)
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench=1; shift ;;
    --sanitize) sanitize=1; shift ;;
    --no-tests) tests=0; shift ;;
    --part)
      case "${2:-}" in
        1) files=("${part1[@]}") ;;
        2) files=(tests); for f in "${part1[@]}"; do files+=("--ignore=$f"); done ;;
        *) echo "device.sh: --part takes 1 or 2" >&2; exit 2 ;;
      esac
      shift 2 ;;
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
  python3 -m pytest -m gpu -v --durations=20 -rfE -p no:cacheprovider "${jobs[@]}" "${files[@]}" "$@" 2>&1 |
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
