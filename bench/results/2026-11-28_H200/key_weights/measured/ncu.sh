# ncu of the key-bias forward in this tree: details and per-SASS source counters
out="${OUT:-/tmp/dmattn-out}"
timeout 200 ncu --clock-control none -k regex:Fwd --launch-skip 2 -c 1 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters \
  -f -o /tmp/ncu_root python3 .patches/kb1.py > "$out/ncu_run.log" 2>&1
ncu -i /tmp/ncu_root.ncu-rep --page details > "$out/details_root.txt" 2>&1
ncu -i /tmp/ncu_root.ncu-rep --page source --csv --print-source sass | gzip > "$out/sass_root.csv.gz"
