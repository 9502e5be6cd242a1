# A deterministic-backward A/B in one device call: the repository root against a copy of it
# with PATCH reversed (AB_APPLY=-R, default: the root has the change) or applied (AB_APPLY=
# "": the root is main), two alternating rounds of bench.run, then the deterministic GPU tests
# and compute-sanitizer on the changed tree. From the repository root, on the device:
#   source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:$PYTHONPATH
#   bash bench/results/2026-11-27_H100/ab_det.sh PATCH ONLY_REGEX "MODES" "SANITIZER TOOLS"
set -uo pipefail
patch_file=$1 only=$2 modes=$3 tools=$4 apply=${AB_APPLY--R}
rm -rf .branches && mkdir -p .branches/other && cp -r dmattn_cute bench tests .branches/other/
patch -s $apply -p1 -d .branches/other < "$patch_file"
changed=$(pwd); [ -z "$apply" ] && changed=$(pwd)/.branches/other
ab() { local d=$(pwd) name=root; [ $1 = other ] && d=$(pwd)/.branches/other && name=other
  (cd $d && PYTHONPATH=$d:$PYTHONPATH timeout 200 python3 -m bench.run --out $OUT/ab_${name}_$2 \
    --suites heads bias --modes $modes --impls ours --only "$only" > $OUT/ab_${name}_$2.log 2>&1)
  grep -E " ours " $OUT/ab_${name}_$2.log | sed "s/^/$name r$2: /"; }
ab root 1; ab other 1; ab other 2; ab root 2
cd "$changed"
PYTHONPATH=$changed:$PYTHONPATH python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  "${jobs[@]}" -k determin tests/ > $OUT/gpu_det.log 2>&1; tail -2 $OUT/gpu_det.log
for tool in $tools; do
  PYTHONPATH=$changed:$PYTHONPATH compute-sanitizer --tool $tool --report-api-errors no \
    python3 -m bench.sanitize > $OUT/sanitize_$tool.log 2>&1; tail -1 $OUT/sanitize_$tool.log
done
