#!/usr/bin/env bash
set -u
source .device/activate.sh && export PYTHONPATH=.:${PYTHONPATH:-}
[ -f .tvmffi/tvmffi.tar.xz ] && { mkdir -p /tmp/tvmffi && tar -xJf .tvmffi/tvmffi.tar.xz -C /tmp/tvmffi; export PYTHONPATH=$PYTHONPATH:/tmp/tvmffi; }
nvidia-smi -L > "$OUT/device.txt"
rm -rf .branches && bash bench/branches.sh --no-tests
probe="$(pwd)/.probe/probe_start8.py"
for r in 1 2; do
  order=(. .branches/early_next); (( r % 2 == 0 )) && order=(.branches/early_next .)
  for t in "${order[@]}"; do
    name=root; [ "$t" = . ] || name=$(basename "$t")
    echo "== $name r$r"
    (cd $t && PYTHONPATH=.:$PYTHONPATH python3 "$probe" 2>&1 | grep -v Warn)
  done
done
