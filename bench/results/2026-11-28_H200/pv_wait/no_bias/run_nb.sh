#!/usr/bin/env bash
set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L > "$OUT/device.txt"; date -u >> "$OUT/device.txt"
rm -rf .branches && bash bench/branches.sh --no-tests
probe="$(pwd)/.probe/probe_nb.py"
trees=(. .branches/*)
for r in 1 2; do
  order=("${trees[@]}"); (( r % 2 == 0 )) && order=($(printf '%s\n' "${trees[@]}" | tac))
  for t in "${order[@]}"; do
    name=root; [ "$t" = . ] || name=$(basename "$t")
    echo "== $name r$r"
    (cd $t && PYTHONPATH=.:$PYTHONPATH python3 "$probe" 2>&1 | grep -v Warn | tee "$OUT/probe_${name}_r$r.log")
  done
done
for t in .branches/*; do
  name=$(basename $t)
  (cd $t && PYTHONPATH=.:$PYTHONPATH timeout ${TEST_TIMEOUT:-250} python3 -m pytest -q -p no:cacheprovider "${jobs[@]}" ${TEST_ARGS:-tests/test_fwd_gpu.py} > "$OUT/tests_$name.log" 2>&1; tail -2 "$OUT/tests_$name.log")
done
