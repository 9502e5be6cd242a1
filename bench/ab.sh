#!/usr/bin/env bash
# A/B timing in one device call: the benchmark with the same arguments in this tree and in
# every branch tree under .branches/ (built from .patches/ by branches.sh, which runs first),
# one after the other on the same GPU. Results go to $OUT/ab_<tree>/ (or /tmp/dmattn-out);
# with AB_TAG set, to $OUT/ab_<tree>_<tag>/, so that several A/Bs of one device call keep
# their files.
#   source .device/activate.sh && [AB_TAG=bias] bash bench/ab.sh --suites bias --modes fwdbwd \
#       --impls ours --only 'bias key mask dense$'
set -uo pipefail
out="${OUT:-/tmp/dmattn-out}"; mkdir -p "$out"
root="$(pwd)"
source bench/carried.sh
status=0
for dir in "$root" "$root"/.branches/*/; do
  [ -d "$dir" ] || continue
  name="$(basename "$dir")"; [ "$dir" = "$root" ] && name=root
  name="$name${AB_TAG:+_$AB_TAG}"
  echo "== $name"
  (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" python3 -m bench.run \
    --out "$out/ab_$name" "$@" 2>&1) | tee "$out/ab_$name.log" | grep -E "^[a-z]+ +(fwd|bwd)"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
exit "$status"
