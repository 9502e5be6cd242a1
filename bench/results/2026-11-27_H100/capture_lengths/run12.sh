source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
root=$(pwd)
rm -rf .branches/main; mkdir -p .branches/main && cp -r dmattn_cute bench tests examples pyproject.toml README.md .branches/main/ && patch -s -p1 -d .branches/main < .patches/main.patch && echo main tree ok
python3 -m pytest -q -p no:cacheprovider "${jobs[@]}" -m gpu -rfE tests/test_kvcache.py tests/test_decode.py tests/test_cache_gpu.py tests/test_precompile.py > $OUT/pytest_capture.log 2>&1; tail -3 $OUT/pytest_capture.log
for r in 1 2; do for t in root main; do dir=$root; [ $t = main ] && dir=$root/.branches/main
  echo "== $t r$r"; (cd $dir && PYTHONPATH=$dir:$PYTHONPATH python3 $root/.patches/probe_eager.py 2>&1 | tee $OUT/eager_${t}_r$r.log); done; done
