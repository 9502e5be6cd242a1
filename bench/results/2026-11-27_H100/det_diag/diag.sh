set -uo pipefail
for r in 1 2; do for v in 0 1 2; do
  DMATTN_DIAG=$v DMATTN_CUTE_CACHE_DIR=/tmp/cache_$v timeout 200 python3 -m bench.run --out $OUT/d${v}_$r \
    --suites heads --modes bwd --impls ours --only 'H32/(32|1)( deterministic)?$' > $OUT/d${v}_$r.log 2>&1
  grep -E " ours " $OUT/d${v}_$r.log | sed "s/^/diag$v r$r: /"
done; done
