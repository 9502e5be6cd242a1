# this tree (root) against .branches/base (main before the mask-bits memo): GPU tests of the
# memo, then the bias/sparse rows with Flex (root) and without (base), alternating
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
rm -rf .branches && mkdir -p .branches/base
cp -r dmattn_cute bench tests .branches/base/
patch -s -p1 -d .branches/base < .patches/base.patch || echo "PATCH FAILED"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider "${jobs[@]}" tests/test_remembered_bits.py \
  tests/test_paired_bits.py tests/test_block_bits_gpu.py tests/test_decode.py 2>&1 | tee $OUT/tests.log | tail -3
only='bf16( bias key)?( mask (dense|blocks128 (1|0.25)))?$'
ab() { local d=$(pwd); [ $1 != root ] && d=$(pwd)/.branches/$1
  (cd $d && PYTHONPATH=$d:$PYTHONPATH timeout $3 python3 -m bench.run --out $OUT/ab_$1_$2 \
    --suites bias sparse --modes fwd fwdbwd --impls ours ours_block_mask $4 --graph --only "$only" > $OUT/ab_$1_$2.log 2>&1)
  grep -E " (ours|ours_block_mask|flex) " $OUT/ab_$1_$2.log | sed "s/^/$1 r$2: /"; }
ab root 1 200 flex; ab base 1 110 ""; ab root 2 110 ""; ab base 2 110 ""
