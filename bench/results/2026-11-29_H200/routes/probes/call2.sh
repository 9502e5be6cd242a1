set -u
source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"; date -u >> "$OUT/device.txt"; git log -1 --format=%h >> "$OUT/device.txt" 2>/dev/null
timeout 150 python3 .probe/host_dev.py 2>&1 | grep -v Warning | tee "$OUT/host_dev.log" | tail -12
timeout 130 python3 -m bench.run --graph --out "$OUT/sparse_r1" --suites sparse --modes fwd --impls ours ours_block_mask flex \
  --only 'bias key mask blocks128 (1|0.25|0.05)$' > "$OUT/sparse_r1.log" 2>&1; echo "r1 rc=$?"
grep -E "^[a-z_0-9]+ +fwd" "$OUT/sparse_r1.log"
OUT=$OUT/part2 timeout 330 bash bench/device.sh --part 2 > "$OUT/part2_stdout.log" 2>&1; echo "part2 rc=$?"; tail -4 "$OUT/part2_stdout.log"
gzip -f "$OUT/part2/pytest_gpu.log" 2>/dev/null
tar -czf "$OUT/sparse.tgz" -C "$OUT" sparse_r1 2>/dev/null; rm -rf "$OUT/sparse_r1"
