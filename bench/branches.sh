#!/usr/bin/env bash
# GPU tests of several unmerged branches in one device call. Each branch travels as a patch
# against the checked-out tree: .patches/<name>.patch (git-ignored, carried to the device with
# `carry: [".device", ".tvmffi", ".pyx", ".patches"]`), made here by
#   mkdir -p .patches && git diff HEAD <branch> > .patches/<name>.patch
# On the device each patch is applied to a copy of the package, tests and bench in
# .branches/<name>/, and every branch runs its own tests against its own package; bench/ab.sh
# then times the same trees.
#   source .device/activate.sh && bash bench/branches.sh [pytest args, default: -m gpu]
#   bash bench/branches.sh --no-tests   # the trees alone, for bench/ab.sh or a probe in each
# Logs go to $OUT/branch_<name>.log (or /tmp/dmattn-out).
set -uo pipefail
out="${OUT:-/tmp/dmattn-out}"; mkdir -p "$out"
root="$(pwd)"
args=()  # pytest runs with -q already: another would hide its summary line
tests=1
for arg in "$@"; do
  case "$arg" in
    --no-tests) tests=0 ;;
    -q) ;;
    *) args+=("$arg") ;;
  esac
done
[ ${#args[@]} -gt 0 ] || args=(-m gpu)
source bench/carried.sh
status=0
for patch in "$root"/.patches/*.patch; do
  [ -f "$patch" ] || continue
  name="$(basename "$patch" .patch)"
  dir="$root/.branches/$name"
  rm -rf "$dir" && mkdir -p "$dir"
  cp -r dmattn_cute bench tests examples pyproject.toml README.md "$dir"/
  if ! patch -s -p1 -d "$dir" < "$patch"; then
    echo "== $name: the patch does not apply"; status=1; continue
  fi
  echo "== $name"
  ((tests)) || continue
  (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" python3 -m pytest -q \
    -p no:cacheprovider "${jobs[@]}" "${args[@]}" 2>&1) | tee "$out/branch_$name.log" | tail -3
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
exit "$status"
