source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
root=$(pwd)
mkdir -p .branches/main && cp -r dmattn_cute bench tests examples pyproject.toml README.md .branches/main/ && patch -s -p1 -d .branches/main < .patches/main.patch && echo main tree ok
python3 -m pytest -q -p no:cacheprovider "${jobs[@]}" -m gpu -rfE tests/test_decode.py tests/test_kvcache.py tests/test_combine.py tests/test_cache_gpu.py tests/test_precompile.py > $OUT/pytest_fold.log 2>&1; tail -3 $OUT/pytest_fold.log
for r in 1 2; do
  order="root main"; [ $r = 2 ] && order="main root"
  for t in $order; do
    dir=$root; [ $t = main ] && dir=$root/.branches/main
    (cd $dir && PYTHONPATH=$dir:$PYTHONPATH python3 $root/.patches/probe_fold.py > $OUT/ceiling_${t}_r$r.log 2>&1); echo "== $t r$r"; grep "^Sk\|ceiling" $OUT/ceiling_${t}_r$r.log
  done
done
AB_ROUNDS=2 bash bench/ab.sh --suites decode --modes fwd --impls ours ours_kvcache_graph flex --only 'Sk(32768|131072) D128 bf16 bias key mask blocks 0.25$' > $OUT/ab.log 2>&1; tail -12 $OUT/ab.log
python3 -m pytest -q -p no:cacheprovider "${jobs[@]}" -m gpu -rfE tests/test_fwd_gpu.py > $OUT/pytest_fwd.log 2>&1; tail -3 $OUT/pytest_fwd.log
