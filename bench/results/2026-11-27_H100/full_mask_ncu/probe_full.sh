set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 ncu --profile-from-start off --clock-control none -k regex:FlashFwdSm90 \
  --section SourceCounters --section WarpStateStats --section InstructionStats --section SpeedOfLight \
  -o $OUT/full -f python3 .patches/probe_full.py > $OUT/ncu.log 2>&1; tail -3 $OUT/ncu.log
ncu -i $OUT/full.ncu-rep --page details --csv > $OUT/details.csv 2>&1
grep -E "Duration|Executed Instructions\"|Issued Warp|No Eligible|Warp Cycles Per Issued" $OUT/details.csv | cut -c1-200
for id in 0 1; do
  ncu -i $OUT/full.ncu-rep --page source --csv --print-source sass --launch-skip $id --launch-count 1 > $OUT/source_$id.csv 2>&1
done
python3 - <<'PY'
import csv, os, collections
out = os.environ["OUT"]
for i in (0, 1):
    rows = list(csv.DictReader(open(f"{out}/source_{i}.csv")))
    if not rows: print("no rows", i); continue
    cols = list(rows[0].keys())
    print(i, cols[:12])
    samp = next(c for c in cols if "Sampling (All" in c)
    exe = next(c for c in cols if c.startswith("Instructions Executed"))
    def num(x):
        try: return float(x.replace(",", ""))
        except Exception: return 0.0
    tot_s = sum(num(r[samp]) for r in rows); tot_e = sum(num(r[exe]) for r in rows)
    print(f"kernel {i}: samples {tot_s:.0f} executed {tot_e:.0f}")
    ops = collections.Counter()
    for r in rows:
        ops[r["Source"].split()[0] if r["Source"].split() else "?"] += num(r[exe])
    print(" ", [(o, int(n)) for o, n in ops.most_common(25)])
    top = sorted(rows, key=lambda r: -num(r[samp]))[:30]
    for r in top:
        print(f"  {r['Address']:>8} {num(r[samp]):8.0f} {num(r[exe]):10.0f}  {r['Source'][:80]}")
PY
