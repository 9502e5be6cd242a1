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
# Carried extras (git-ignored), each an xz tarball of unzipped wheels:
# - .fa4/fa4.tar.xz: FlashAttention 4 and its deps (apache-tvm-ffi too), a benchmark peer;
# - .tvmffi/tvmffi.tar.xz: apache-tvm-ffi alone (the DSL's launch path), for calls that need
#   no FA4 (a smaller carry);
# - .pyx/xdist.tar.xz: pytest-xdist and execnet (the GPU tests are bound by kernel compiles,
#   which then use every core); .pydeps/xdist.tar.xz: the same plus apache-tvm-ffi.
jobs=()
if [ -f .fa4/fa4.tar.xz ]; then
  [ -d /tmp/fa4/flash_attn ] || { mkdir -p /tmp/fa4 && tar -xJf .fa4/fa4.tar.xz -C /tmp/fa4; }
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/fa4"
elif [ -f .tvmffi/tvmffi.tar.xz ]; then
  [ -d /tmp/tvmffi/tvm_ffi ] || { mkdir -p /tmp/tvmffi && tar -xJf .tvmffi/tvmffi.tar.xz -C /tmp/tvmffi; }
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/tvmffi"
fi
for tarball in .pyx/xdist.tar.xz .pydeps/xdist.tar.xz; do
  if [ -f "$tarball" ]; then
    mkdir -p /tmp/pydeps && tar -xJf "$tarball" -C /tmp/pydeps
    export PYTHONPATH="/tmp/pydeps${PYTHONPATH:+:$PYTHONPATH}"
    jobs=(-n "${JOBS:-12}")
    break
  fi
done
status=0
if [ "$tests" = 1 ]; then
  python3 -m pytest -m gpu -q -rfE -p no:cacheprovider "${jobs[@]}" "$@" 2>&1 | tee "$out/pytest_gpu.log" | tail -40
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
