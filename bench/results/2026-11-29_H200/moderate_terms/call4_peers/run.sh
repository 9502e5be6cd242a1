#!/usr/bin/env bash
# Issue 14's ratios in one call: bench.run twice with ours, ours_block_mask, Flex and FA4,
# then compute-sanitizer racecheck and memcheck of bench.sanitize
set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L > "$OUT/device.txt"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/device.txt"; date -u >> "$OUT/device.txt"
ONLY='^S4096 D(64|128|256) bf16$|^S4096 D128 bf16 bias key( mask dense)?$|blocks128 (1|0.25|0.05)$'
run() {
  timeout "$2" python3 -m bench.run --out "$OUT/peers_r$1" --suites dense bias sparse --modes fwd \
    --impls ours ours_block_mask flex fa4 --only "$ONLY" > "$OUT/peers_r$1.log" 2>&1
  echo "r$1 rc=$? $(date -u +%T)"; grep -E "^[a-z_0-9]+ +fwd" "$OUT/peers_r$1.log" | head -40
}
run 1 230
for tool in racecheck memcheck; do
  timeout 110 compute-sanitizer --tool "$tool" --report-api-errors no python3 -m bench.sanitize > "$OUT/sanitize_$tool.log" 2>&1
  echo "$tool rc=$?"; tail -n 2 "$OUT/sanitize_$tool.log"
done
run 2 150
tar -czf "$OUT/peers.tgz" -C "$OUT" peers_r1 peers_r2 2>/dev/null; rm -rf "$OUT/peers_r1" "$OUT/peers_r2"
