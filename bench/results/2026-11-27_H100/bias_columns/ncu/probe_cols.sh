# ncu of the key-bias forward: main (root) against the bias-columns variant (.branches/cols)
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
rm -rf .branches && mkdir -p .branches/cols && cp -r dmattn_cute tests .branches/cols/
patch -s -p1 -d .branches/cols < .patches/bias_columns.patch || echo "PATCH FAILED"
for t in root cols; do d=$(pwd); [ $t != root ] && d=$(pwd)/.branches/$t
  (cd $d && PYTHONPATH=$d:$PYTHONPATH timeout 200 ncu --profile-from-start off --clock-control none \
    -k regex:FlashFwdSm90 --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    -o $OUT/$t -f python3 $OLDPWD/.patches/probe_cols.py > $OUT/ncu_$t.log 2>&1; tail -1 $OUT/ncu_$t.log)
  ncu -i $OUT/$t.ncu-rep --page details --csv > $OUT/details_$t.csv 2>&1
  ncu -i $OUT/$t.ncu-rep --page source --csv --print-source sass > $OUT/source_$t.csv 2>&1
  gzip $OUT/source_$t.csv; rm -f $OUT/$t.ncu-rep
  grep -E "\"Duration\"|Executed Instructions\"" $OUT/details_$t.csv | cut -c1-200
done
