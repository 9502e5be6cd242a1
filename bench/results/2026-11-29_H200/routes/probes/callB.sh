set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"; date -u >> "$OUT/device.txt"
OUT=$OUT/part2 timeout 320 bash bench/device.sh --part 2 > "$OUT/part2_stdout.log" 2>&1; echo "part2 rc=$?"; tail -2 "$OUT/part2_stdout.log"
gzip -f "$OUT/part2/pytest_gpu.log" 2>/dev/null
timeout 150 python3 -m bench.run --graph --out "$OUT/sparse_r2" --suites sparse --modes fwd --impls ours ours_block_mask flex \
  --only 'bias key mask blocks128 (0.25|0.05)$' > "$OUT/sparse_r2.log" 2>&1; echo "r2 rc=$?"
grep -E "^[a-z_0-9]+ +fwd" "$OUT/sparse_r2.log"
timeout 60 python3 .probe/after_flex.py 2>&1 | grep -v Warn > "$OUT/after_flex.log"; cat "$OUT/after_flex.log"
tar -czf "$OUT/sparse.tgz" -C "$OUT" sparse_r2 2>/dev/null; rm -rf "$OUT/sparse_r2"
