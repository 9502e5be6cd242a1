# main (root) against .branches/early (early_take) and .branches/both (early_take + det_spread)
set -uo pipefail
only='H32/|bf16 bias key mask dense( deterministic)?$'
rm -rf .branches && mkdir -p .branches/early .branches/both
for b in early both; do cp -r dmattn_cute bench tests .branches/$b/; done
patch -s -p1 -d .branches/early < .patches/early_take.patch
patch -s -p1 -d .branches/both < .patches/early_take.patch
patch -s -p1 -d .branches/both < .patches/det_spread.patch
ab() { local d=$(pwd); [ $1 != root ] && d=$(pwd)/.branches/$1
  (cd $d && PYTHONPATH=$d:$PYTHONPATH timeout 150 python3 -m bench.run --out $OUT/ab_$1_$2 \
    --suites heads bias --modes bwd --impls ours --only "$only" > $OUT/ab_$1_$2.log 2>&1)
  grep -E " ours " $OUT/ab_$1_$2.log | sed "s/^/$1 r$2: /"; }
ab root 1; ab early 1; ab both 1; ab both 2; ab early 2; ab root 2
