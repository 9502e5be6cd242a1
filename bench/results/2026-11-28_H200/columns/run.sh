#!/usr/bin/env bash
# graph probe (8 blocks) and bench rows in main, columns, fullvis (both orders); columns' bias tests
set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L > "$OUT/device.txt"; date -u >> "$OUT/device.txt"
rm -rf .branches && bash bench/branches.sh --no-tests
probe="$(pwd)/.probe/probe_start8.py"
trees=(. .branches/*)
for r in 1 2; do
  order=("${trees[@]}"); (( r % 2 == 0 )) && order=($(printf '%s\n' "${trees[@]}" | tac))
  for t in "${order[@]}"; do
    name=root; [ "$t" = . ] || name=$(basename "$t")
    echo "== $name r$r"
    (cd $t && PYTHONPATH=.:$PYTHONPATH python3 "$probe" 2>&1 | grep -v Warn | tee "$OUT/start_${name}_r$r.log")
  done
done
AB_ROUNDS=2 bash bench/ab.sh --suites bias sparse --modes fwd --impls ours ours_block_mask --only 'bf16( bias key( mask (dense|blocks128 (1|0.25)))?)?$' 2>&1 | grep -v Warn
(cd .branches/columns && PYTHONPATH=.:$PYTHONPATH timeout 300 python3 -m pytest -q -p no:cacheprovider "${jobs[@]}" tests/test_fwd_gpu.py tests/test_edge_cases_gpu.py tests/test_decode.py -k "bias or softcap" > "$OUT/tests_columns.log" 2>&1; tail -3 "$OUT/tests_columns.log")
cd "$OUT" && tar czf ab.tgz ab_*/ && rm -rf ab_*/
