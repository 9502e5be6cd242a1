# root (one-loop deterministic walks) vs main (HEAD): heads + key-bias bwd rows, alternating; then det GPU tests + racecheck on root
set -uo pipefail
rm -rf .branches && mkdir -p .branches/main && cp -r dmattn_cute bench tests .lp .branches/main/ && patch -s -R -p1 -d .branches/main < .patches/det.patch
ab() { local d=$(pwd); [ $1 = root ] || d=$(pwd)/.branches/$1
  (cd $d && PYTHONPATH=$d:$PYTHONPATH timeout 150 python3 -m bench.run --out $OUT/ab_$1_$2 --suites heads bias --modes bwd --impls ours --only 'H32/|bf16 bias key mask dense( deterministic)?$' > $OUT/ab_$1_$2.log 2>&1)
  grep -E " ours " $OUT/ab_$1_$2.log | sed "s/^/$1 r$2: /"; }
ab root 1; ab main 1; ab main 2; ab root 2
python3 -m pytest -m gpu -q -rfE -p no:cacheprovider "${jobs[@]}" -k determin tests/ > $OUT/gpu_det.log 2>&1; tail -2 $OUT/gpu_det.log
compute-sanitizer --tool racecheck --report-api-errors no python3 -m bench.sanitize > $OUT/sanitize_racecheck.log 2>&1; tail -1 $OUT/sanitize_racecheck.log
