# this tree (root: dense walk + bias columns) against .branches/dw (dense walk only) and
# .branches/base (main 6591525): forward GPU tests, then forward rows with Flex, alternating
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
rm -rf .branches && mkdir -p .branches/base .branches/dw
for b in base dw; do cp -r dmattn_cute bench tests .branches/$b/; done
patch -s -p1 -d .branches/base < .patches/base.patch || echo "PATCH FAILED base"
patch -s -p1 -d .branches/dw < .patches/dw.patch || echo "PATCH FAILED dw"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider "${jobs[@]}" tests/test_fwd_gpu.py \
  tests/test_decode.py tests/test_kvcache.py tests/test_block_mask.py 2>&1 | tee $OUT/tests.log | tail -3
only='bf16( bias key)?( mask (dense|blocks128 (1|0.25)))?$|Sq1 Sk(32768|131072) D128 bf16 bias key mask blocks 0.25$'
ab() { local d=$(pwd); [ $1 != root ] && d=$(pwd)/.branches/$1
  (cd $d && PYTHONPATH=$d:$PYTHONPATH timeout $3 python3 -m bench.run --out $OUT/ab_$1_$2 \
    --suites bias sparse decode --modes fwd --impls ours ours_block_mask ours_kvcache_graph $4 --only "$only" > $OUT/ab_$1_$2.log 2>&1)
  grep -E " (ours|ours_block_mask|ours_kvcache_graph|flex) " $OUT/ab_$1_$2.log | sed "s/^/$1 r$2: /"; }
ab root 1 150 flex; ab base 1 80 ""; ab dw 1 80 ""; ab root 2 80 ""; ab dw 2 80 ""; ab base 2 80 ""
