#!/usr/bin/env bash
# GPU tests of several unmerged branches in one device call. Each branch's tree is exported
# (without .git) to .branches/<name>/ in the main checkout, which is git-ignored and carried
# to the device with `carry: [".device", ".fa4", ".pyx", ".branches"]`; every branch then runs
# its own tests against its own package.
#   git archive <branch> | (mkdir -p .branches/<name> && tar -x -C .branches/<name>)
#   source .device/activate.sh && bash bench/branches.sh [pytest args, default: -m gpu]
# Logs go to $OUT/branch_<name>.log (or /tmp/dmattn-out).
set -uo pipefail
out="${OUT:-/tmp/dmattn-out}"; mkdir -p "$out"
root="$(pwd)"
args=("$@"); [ ${#args[@]} -gt 0 ] || args=(-m gpu)
# the same extras as device.sh: FlashAttention 4 (and tvm_ffi), pytest-xdist
[ -d /tmp/fa4/flash_attn ] || { mkdir -p /tmp/fa4 && tar -xJf .fa4/fa4.tar.xz -C /tmp/fa4; }
[ -d /tmp/pydeps/xdist ] || { mkdir -p /tmp/pydeps && tar -xJf .pyx/xdist.tar.xz -C /tmp/pydeps; }
status=0
for dir in "$root"/.branches/*/; do
  name="$(basename "$dir")"
  echo "== $name"
  (cd "$dir" && PYTHONPATH="/tmp/pydeps:${PYTHONPATH:-}:/tmp/fa4" python3 -m pytest -q \
    -p no:cacheprovider -n "${JOBS:-12}" "${args[@]}" 2>&1) | tee "$out/branch_$name.log" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
exit "$status"
