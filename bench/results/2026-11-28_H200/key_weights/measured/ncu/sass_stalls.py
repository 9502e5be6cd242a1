"""Summarize ncu source pages (--page source --csv --print-source sass, gzipped): samples,
stall reasons, excess shared wavefronts, and the SASS lines with the most stall samples.
    python3 sass_stalls.py sass_main_df96f65.csv.gz sass_3a46add.csv.gz"""

import csv
import gzip
import sys

for path in sys.argv[1:]:
    with gzip.open(path, "rt") as file:
        rows = list(csv.reader(file))
    hdr, data = rows[1], rows[2:]
    col = {n: i for i, n in enumerate(hdr)}

    def f(r, n, col=col):
        return float(r[col[n]] or 0)

    samples = "Warp Stall Sampling (All Samples)"
    total = sum(f(r, samples) for r in data)
    excess = sum(f(r, "L1 Wavefronts Shared Excessive") for r in data)
    print(f"== {path}: samples {total:.0f}, excess shared wavefronts {excess:.0f}")
    stalls = [n for n in hdr if n.startswith("stall_") and "Not Issued" not in n]
    share = sorted(((sum(f(r, s) for r in data) / total * 100, s) for s in stalls), reverse=True)
    print("  " + ", ".join(f"{s} {p:.1f}%" for p, s in share[:8]))
    for r in sorted(data, key=lambda r: -f(r, samples))[:20]:
        reason = max(stalls, key=lambda s: f(r, s))
        source = r[col["Source"]].strip()[:60]
        print(
            f"  {r[0][-5:]} {source:60s} {f(r, samples):6.0f} {reason} x{f(r, 'Instructions Executed'):.0f}"
        )
