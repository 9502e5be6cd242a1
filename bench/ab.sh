#!/usr/bin/env bash
# A/B timing in one device call: the benchmark with the same arguments in this tree and in
# every branch tree under .branches/ (built from .patches/ by branches.sh), one after the
# other on the same GPU. Results go to $OUT/ab_<tree>/ (or /tmp/dmattn-out); with AB_TAG set,
# to $OUT/ab_<tree>_<tag>/, so that several A/Bs of one device call keep their files. With
# AB_ROUNDS=n (default 1) the whole comparison runs n times, every other round in reverse
# tree order, into .../ab_<tree>[_<tag>]_r<round>/: identical trees differ by up to 3% between
# two processes (bench/results/2026-11-26_H200/ab_same_tree/), and the first tree of a call
# is not always the fastest, so a few-percent difference needs both orders.
#   source .device/activate.sh && [AB_TAG=bias] [AB_ROUNDS=2] bash bench/ab.sh \
#       --suites bias --modes fwdbwd --impls ours --only 'bias key mask dense$'
# With AB_PROBE=<script> each tree runs `python3 <script> [args]` (a probe of its own
# timings, from the tree's root) in place of the benchmark, its output whole in
# $OUT/probe_<tree>[_<tag>][_r<round>].log.
set -uo pipefail
out="${OUT:-/tmp/dmattn-out}"; mkdir -p "$out"
root="$(pwd)"
source bench/carried.sh
rounds="${AB_ROUNDS:-1}"
probe="${AB_PROBE:+$(realpath "$AB_PROBE")}"  # the same script in every tree
trees=("$root")
for dir in "$root"/.branches/*/; do
  [ -d "$dir" ] && trees+=("${dir%/}")
done
status=0
for ((round = 1; round <= rounds; round++)); do
  order=("${trees[@]}")
  if ((round % 2 == 0)); then  # even rounds: the trees in reverse
    order=()
    for ((i = ${#trees[@]} - 1; i >= 0; i--)); do order+=("${trees[i]}"); done
  fi
  for dir in "${order[@]}"; do
    name="$(basename "$dir")"; [ "$dir" = "$root" ] && name=root
    name="$name${AB_TAG:+_$AB_TAG}"
    ((rounds > 1)) && name="${name}_r$round"
    echo "== $name"
    if [ -n "${AB_PROBE:-}" ]; then
      (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" python3 "$probe" "$@" 2>&1) |
        tee "$out/probe_$name.log"
    else
      (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" python3 -m bench.run \
        --out "$out/ab_$name" "$@" 2>&1) | tee "$out/ab_$name.log" | grep -E "^[a-z]+ +(fwd|bwd)"
    fi
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
done
exit "$status"
