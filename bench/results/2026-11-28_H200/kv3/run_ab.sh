#!/usr/bin/env bash
# A/B of main (root) against every .patches/<name>.patch tree: forward rows of issue 14
# (AB_ROUNDS=2, both orders); then, with BRANCH_TESTS=<name>, that tree's GPU tests selected
# by TEST_ARGS.
set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L > "$OUT/device.txt"; date -u >> "$OUT/device.txt"
rm -rf .branches && bash bench/branches.sh --no-tests  # (the recorded runs: an inline copy)
AB_ROUNDS=${ROUNDS:-2} bash bench/ab.sh --suites ${SUITES:-bias sparse} --modes fwd --impls ours ${IMPLS:-} --only "${ONLY:-bf16( bias key( mask dense)?)?\$}"
if [ -n "${BRANCH_TESTS:-}" ]; then
  (cd .branches/$BRANCH_TESTS && PYTHONPATH=.:$PYTHONPATH timeout ${TEST_TIMEOUT:-280} python3 -m pytest -q -p no:cacheprovider "${jobs[@]}" ${TEST_ARGS:-tests/test_fwd_gpu.py tests/test_edge_cases_gpu.py -k bias} > "$OUT/tests_$BRANCH_TESTS.log" 2>&1; tail -2 "$OUT/tests_$BRANCH_TESTS.log")
fi
