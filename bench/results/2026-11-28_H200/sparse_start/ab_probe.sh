#!/usr/bin/env bash
# probe_start.py in main (root) and every .patches/<name>.patch tree, ROUNDS rounds in
# alternating order; then bench/ab.sh on the issue 14 rows. PROBE: the probe's path (the
# recorded run had it at .probe/probe_start.py and built the trees with an inline copy of
# branches.sh's loop).
set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L > "$OUT/device.txt"; date -u >> "$OUT/device.txt"
rm -rf .branches && bash bench/branches.sh --no-tests
probe="$(pwd)/${PROBE:-.probe/probe_start.py}"
trees=(. .branches/*)
for r in $(seq 1 ${ROUNDS:-2}); do
  order=("${trees[@]}"); (( r % 2 == 0 )) && order=($(printf '%s\n' "${trees[@]}" | tac))
  for t in "${order[@]}"; do
    name=root; [ "$t" = . ] || name=$(basename "$t")
    echo "== $name r$r"
    (cd $t && PYTHONPATH=.:$PYTHONPATH python3 "$probe" 2>&1 | grep -v Warn | tee "$OUT/start_${name}_r$r.log")
  done
done
AB_ROUNDS=${ROUNDS:-2} bash bench/ab.sh --suites bias sparse --modes fwd --impls ours ours_block_mask --only "${ONLY:-bf16( bias key( mask (dense|blocks128 (1|0.25)))?)?\$}" 2>&1 | grep -v Warn
