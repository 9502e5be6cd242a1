source .device/activate.sh && source bench/carried.sh && export PYTHONPATH=.:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
for L in 1 8 16; do python3 -m bench.decode_layers --layers $L --out $OUT/layers_$L > $OUT/layers_$L.log 2>&1; echo "== layers $L"; grep "^Sk" $OUT/layers_$L.log; done
python3 -m bench.decode_layers --layers 8 --out $OUT/layers_8b > $OUT/layers_8b.log 2>&1; echo "== layers 8 again"; grep "^Sk" $OUT/layers_8b.log
python3 -m bench.run --out $OUT/decode --suites decode --modes fwd --impls ours ours_kvcache_graph flex --only 'Sk(32768|131072) D128 bf16 bias key mask blocks 0.25$' > $OUT/decode.log 2>&1; grep -E "^decode" $OUT/decode.log
