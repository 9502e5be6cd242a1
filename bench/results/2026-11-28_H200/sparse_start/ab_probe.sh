#!/usr/bin/env bash
# probe_start.py in main (root) and every .patches/<name>.patch tree, ROUNDS rounds in
# alternating order; then bench/ab.sh on the issue 14 rows.
set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L > "$OUT/device.txt"; date -u >> "$OUT/device.txt"
rm -rf .branches
for p in .patches/*.patch; do
  name=$(basename "$p" .patch)
  mkdir -p .branches/$name && cp -r dmattn_cute bench pyproject.toml .probe .branches/$name/
  patch -s -p1 -d .branches/$name < "$p" || echo "patch $name failed"
done
trees=(. .branches/*)
for r in $(seq 1 ${ROUNDS:-2}); do
  order=("${trees[@]}"); (( r % 2 == 0 )) && order=($(printf '%s\n' "${trees[@]}" | tac))
  for t in "${order[@]}"; do
    name=$(basename $(cd $t && pwd)); [ "$t" = . ] && name=root
    echo "== $name r$r"
    (cd $t && PYTHONPATH=.:$PYTHONPATH python3 .probe/probe_start.py 2>&1 | grep -v Warn | tee "$OUT/start_${name}_r$r.log")
  done
done
AB_ROUNDS=${ROUNDS:-2} bash bench/ab.sh --suites bias sparse --modes fwd --impls ours ours_block_mask --only "${ONLY:-bf16( bias key( mask (dense|blocks128 (1|0.25)))?)?\$}" 2>&1 | grep -v Warn
