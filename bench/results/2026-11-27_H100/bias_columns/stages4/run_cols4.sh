# .branches/cols4 (bias columns, 4 stages) against this tree (main): forward rows, alternating
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
rm -rf .branches && mkdir -p .branches/cols4 && cp -r dmattn_cute bench tests .branches/cols4/
patch -s -p1 -d .branches/cols4 < .patches/cols4.patch || echo "PATCH FAILED"
only='bf16( bias key)?( mask dense)?$'
ab() { local d=$(pwd); [ $1 != root ] && d=$(pwd)/.branches/$1
  (cd $d && PYTHONPATH=$d:$PYTHONPATH timeout $3 python3 -m bench.run --out $OUT/ab_$1_$2 \
    --suites bias --modes fwd --impls ours --only "$only" > $OUT/ab_$1_$2.log 2>&1)
  grep -E " ours " $OUT/ab_$1_$2.log | sed "s/^/$1 r$2: /"; }
ab cols4 1 80; ab root 1 60; ab cols4 2 40; ab root 2 40
