#!/usr/bin/env bash
# fold experiment: tests of the fold tree, then A/B fold (root) against main
set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L > "$OUT/device.txt"; date -u >> "$OUT/device.txt"
rm -rf .branches && mkdir -p .branches/main && cp -r dmattn_cute bench tests pyproject.toml README.md .branches/main/ && patch -s -p1 -d .branches/main < .patches/main.patch
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_LIMIT:-280}" python3 -m pytest -q -p no:cacheprovider "${jobs[@]}" ${TEST_ARGS:-tests/test_fwd_gpu.py tests/test_edge_cases_gpu.py} > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20; tail -2 "$OUT/tests.log"
fi
AB_ROUNDS=${ROUNDS:-2} bash bench/ab.sh --suites bias sparse --modes fwd --impls ours ours_block_mask --only "${ONLY:-bf16( bias key( mask (dense|blocks128 (1|0.25)))?)?\$}"
