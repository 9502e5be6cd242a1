#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then (with --bench) the benchmark.
# Usage (repo root, after `source .device/activate.sh`): bash bench/device.sh [--bench] [pytest args]
# Logs go to $OUT (or /tmp/dmattn-out).
set -uo pipefail
out="${OUT:-/tmp/dmattn-out}"; mkdir -p "$out"
bench=0
if [ "${1:-}" = "--bench" ]; then bench=1; shift; fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
export PYTHONUNBUFFERED=1
python3 -m pytest -m gpu -q -rfE -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest_gpu.log" | tail -40
status=${PIPESTATUS[0]}
if [ "$bench" = 1 ]; then
  python3 -m bench.run --out "$out" 2>&1 | tee "$out/bench.log" | tail -60
fi
exit "$status"
