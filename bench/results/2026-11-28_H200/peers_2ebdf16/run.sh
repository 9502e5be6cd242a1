#!/usr/bin/env bash
# host profile; same-run peers (Flex, FA4) twice; A/B of loop_limits against main
set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L > "$OUT/device.txt"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/device.txt"; date -u >> "$OUT/device.txt"
python3 .probe/host_prof.py -p > "$OUT/host_prof.log" 2>&1; grep "host us" "$OUT/host_prof.log"
ONLY='^S4096 D(64|128|256) bf16$|^S4096 D128 bf16 bias key( mask dense)?$|blocks128 (1|0.25|0.05)$'
for r in 1 2; do
  python3 -m bench.run --out "$OUT/peers_r$r" --suites dense bias sparse --modes fwd \
    --impls ours ours_block_mask flex fa4 --only "$ONLY" > "$OUT/peers_r$r.log" 2>&1
  grep -E "^[a-z_0-9]+ +fwd" "$OUT/peers_r$r.log" | head -40
done
rm -rf .branches && bash bench/branches.sh --no-tests
AB_ROUNDS=2 bash bench/ab.sh --suites bias sparse --modes fwd --impls ours ours_block_mask \
  --only '^S4096 D128 bf16$|bias key( mask dense)?$|blocks128 (1|0.25)$'
