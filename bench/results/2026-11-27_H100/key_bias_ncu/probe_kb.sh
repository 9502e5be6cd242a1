set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 300 ncu --profile-from-start off --clock-control none -k regex:FlashFwdSm90 \
  --section SourceCounters --section WarpStateStats --section InstructionStats --section SpeedOfLight \
  --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.sum,sm__inst_executed_pipe_fma.sum,sm__inst_executed_pipe_alu.sum \
  -o $OUT/kb -f python3 .patches/probe_kb.py > $OUT/ncu.log 2>&1; tail -3 $OUT/ncu.log
ncu -i $OUT/kb.ncu-rep --page details --csv > $OUT/details.csv 2>&1
ncu -i $OUT/kb.ncu-rep --page raw --csv > $OUT/raw.csv 2>&1; gzip $OUT/raw.csv
grep -E "Duration|Executed Instructions\"|gmma|No Eligible|Warp Cycles Per Issued|Issue Slots" $OUT/details.csv | cut -c1-220
for id in 0 1; do
  ncu -i $OUT/kb.ncu-rep --page source --csv --print-source sass --launch-skip $id --launch-count 1 > $OUT/source_$id.csv 2>&1
  gzip $OUT/source_$id.csv
done
rm -f $OUT/kb.ncu-rep
