set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 130 python3 -m bench.run --out $OUT/dense --suites bias sparse --modes fwd --impls ours ours_block_mask flex \
  --only 'bf16 bias key( mask (dense|blocks128 (1|0.25)))?$' > $OUT/dense.log 2>&1; grep -E " (ours|ours_block_mask|flex) " $OUT/dense.log
timeout 60 python3 .patches/check_dense.py 2>&1 | tail -12
