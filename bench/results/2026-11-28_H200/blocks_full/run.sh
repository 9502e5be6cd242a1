#!/usr/bin/env bash
# root = blocks-full: GPU tests part 2 + sanitizers; then A/B against main (probe + bench rows)
set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L > "$OUT/device.txt"; date -u >> "$OUT/device.txt"
mkdir -p "$OUT/tests" && OUT="$OUT/tests" bash bench/device.sh --part 2 --sanitize 2>&1 | tail -8
rm -rf .branches && bash bench/branches.sh --no-tests
probe="$(pwd)/.probe/probe_start8.py"
trees=(. .branches/*)
for r in 1 2; do
  order=("${trees[@]}"); (( r % 2 == 0 )) && order=($(printf '%s\n' "${trees[@]}" | tac))
  for t in "${order[@]}"; do
    name=root; [ "$t" = . ] || name=$(basename "$t")
    echo "== $name r$r"
    (cd $t && PYTHONPATH=.:$PYTHONPATH python3 "$probe" 2>&1 | grep -v Warn > "$OUT/start_${name}_r$r.log"; cat "$OUT/start_${name}_r$r.log")
  done
done
AB_ROUNDS=2 bash bench/ab.sh --suites sparse --modes fwd --impls ours ours_block_mask --only 'blocks128 (1|0.25)$|blocks128 0.25 causal$' 2>&1 | grep -v Warn
cd "$OUT" && tar czf ab.tgz ab_*/ start_*.log && rm -rf ab_*/ start_*.log
