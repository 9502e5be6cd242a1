#!/usr/bin/env bash
# One device call: the bias suite's forward rows with FlexAttention (issue 14's bias + dense
# mask target), two rounds; then probe_density.py (forward time against density and length).
set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi -L > "$OUT/device.txt"; date -u >> "$OUT/device.txt"; git log -1 --format=%h >> "$OUT/device.txt"
for r in 1 2; do
  python3 -m bench.run --out "$OUT/bias_r$r" --suites bias --modes fwd --impls ours flex \
    --only 'bf16( bias key( mask dense)?)?$' 2>&1 | tee "$OUT/bias_r$r.log" | grep -E "^[a-z]+ +fwd"
done
python3 bench/results/2026-11-28_H200/density_length/probe_density.py 2>&1 | tee "$OUT/density.log" | grep '^{'
