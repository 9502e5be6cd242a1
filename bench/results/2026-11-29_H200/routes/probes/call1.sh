set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"; date -u >> "$OUT/device.txt"
timeout 200 python3 .probe/host_dev.py 2>&1 | grep -v Warning | tee "$OUT/host_dev.log" | tail -20
for r in 1 2; do
timeout 150 python3 -m bench.run --graph --out "$OUT/sparse_r$r" --suites sparse --modes fwd --impls ours ours_block_mask flex \
  --only 'bias key mask blocks128 (1|0.25|0.05)$' > "$OUT/sparse_r$r.log" 2>&1; echo "r$r rc=$?"
grep -E "^[a-z_0-9]+ +fwd" "$OUT/sparse_r$r.log"
done
tar -czf "$OUT/sparse.tgz" -C "$OUT" sparse_r1 sparse_r2 2>/dev/null; rm -rf "$OUT/sparse_r1" "$OUT/sparse_r2"
