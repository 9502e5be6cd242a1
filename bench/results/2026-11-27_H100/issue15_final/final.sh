set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 250 python3 -m bench.run --out $OUT/flex --suites bias sparse --modes fwdbwd --impls ours ours_block_mask flex --graph \
  --only 'bf16 bias key mask (dense|blocks128 (1|0.25))$' > $OUT/flex.log 2>&1; grep -E " (ours|ours_block_mask|flex) " $OUT/flex.log
timeout 200 python3 -m bench.run --out $OUT/heads --suites heads bias --modes bwd --impls ours \
  --only 'H32/|bf16 bias key mask dense( deterministic)?$' > $OUT/heads.log 2>&1; grep -E " ours " $OUT/heads.log
