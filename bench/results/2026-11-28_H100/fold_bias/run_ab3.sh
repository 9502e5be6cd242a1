#!/usr/bin/env bash
# Next session: A/B of main (root) against kv3 (a third K/V stage, key bias row alone) and
# fold3 (fold-bias with three stages), forward rows of issue 14; then the bias GPU tests of
# the faster branch tree if it beats main (BRANCH_TESTS=kv3|fold3 to choose by hand).
set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L > "$OUT/device.txt"; date -u >> "$OUT/device.txt"
rm -rf .branches
for name in kv3 fold3; do
  mkdir -p .branches/$name && cp -r dmattn_cute bench tests pyproject.toml README.md .branches/$name/
  patch -s -p1 -d .branches/$name < .patches/$name.patch || echo "patch $name failed"
done
AB_ROUNDS=${ROUNDS:-2} bash bench/ab.sh --suites bias --modes fwd --impls ours --only "${ONLY:-bf16( bias key( mask dense)?)?\$}"
if [ -n "${BRANCH_TESTS:-}" ]; then
  (cd .branches/$BRANCH_TESTS && PYTHONPATH=.:$PYTHONPATH timeout 280 python3 -m pytest -q -p no:cacheprovider "${jobs[@]}" tests/test_fwd_gpu.py tests/test_edge_cases_gpu.py -k bias > "$OUT/tests_$BRANCH_TESTS.log" 2>&1; tail -2 "$OUT/tests_$BRANCH_TESTS.log")
fi
