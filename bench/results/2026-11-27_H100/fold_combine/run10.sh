source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
root=$(pwd)
for b in main selfreset; do rm -rf .branches/$b; mkdir -p .branches/$b && cp -r dmattn_cute bench tests examples pyproject.toml README.md .branches/$b/ && patch -s -p1 -d .branches/$b < .patches/$b.patch && echo $b tree ok; done
python3 -m pytest -q -p no:cacheprovider "${jobs[@]}" -m gpu -rfE tests/test_decode.py -k "merges or plain_decode or split_decode" > $OUT/pytest_prefetch.log 2>&1; tail -2 $OUT/pytest_prefetch.log
for r in 1 2; do
  order="root main selfreset"; [ $r = 2 ] && order="selfreset main root"
  for t in $order; do
    dir=$root; [ $t != root ] && dir=$root/.branches/$t
    (cd $dir && PYTHONPATH=$dir:$PYTHONPATH python3 $root/.patches/probe_fold.py > $OUT/ceiling_${t}_r$r.log 2>&1); echo "== $t r$r"; grep "^Sk" $OUT/ceiling_${t}_r$r.log
  done
done
(python3 .patches/probe_kernels.py > $OUT/kernels_root.log 2>&1); grep -v Warn $OUT/kernels_root.log | cut -c1-100
