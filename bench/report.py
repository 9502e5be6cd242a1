"""Tables and plots from the benchmark's results.json files (runs anywhere; plots need
matplotlib).

    python3 -m bench.report RESULTS.json[.gz] [MORE ...] --out bench/results --name NAME

Writes NAME.md (a summary table per suite and mode, then every measurement, with the
environment of each run) and NAME_speedup_vs_density.png / NAME_tflops_vs_seqlen.png.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

OURS = "ours"
# Column title -> (record key, format); a missing value prints as "-".
COLUMNS = {
    "workload": ("workload", ""),
    "impl": ("impl", ""),
    "ms": ("ms", ".3f"),
    "TFLOP/s (dense-eq)": ("tflops", ".1f"),
    "TFLOP/s (executed)": ("executed_tflops", ".1f"),
    "time / ours": ("speedup", ".2f"),
    "peak MiB": ("peak_mib", ".0f"),
    "first call s": ("first_call_s", ".2f"),
    "host ms": ("host_ms", ".3f"),
    "graph ms": ("graph_ms", ".3f"),
    "rel err vs ours": ("rel_err", ".1e"),
    "note": ("note", ""),
}
HOW_TO_READ = """\
- ms: median time of one call; TFLOP/s (dense-eq): 4·B·H·Sq·Sk·D per forward (halved when
  causal, x2.5 for the backward, x3.5 for both) over that time, whatever the mask skips;
  TFLOP/s (executed): the same over the tiles our kernels actually run (tiles with a visible
  key), so sparse rows can be compared with dense ones.
- time / ours: this row's ms over ours (> 1: ours is faster).
- peak MiB: memory one call allocates beyond its inputs; first call s: compile and warm-up,
  excluded from ms (ours: loading kernels compiled before timing, where the run says so, as
  a user would precompile them; the peers compile in their first call); host ms: CPU time to enqueue one call (a row is host-bound where it nears
  ms); graph ms (bench.run --graph: ours, and the peers in fwd): the call's GPU time alone,
  by CUDA graph replay after a clean L2 flush (a read, where ms follows do_bench's zero_ of
  256 MB, whose dirty lines are written back during the call), the time to compare where a
  row is host-bound.
- rel err vs ours: ||out - ours|| / ||ours|| of the forward output, checked before timing; a
  peer above 2e-2 (bf16) / 1e-2 (fp16) is listed as skipped, not timed.
- † (summary): host-bound, host ms at least 0.8 x ms: the time is the CPU's enqueue time more
  than the GPU's, and its ratio moves with the machine's CPU between runs.
"""
HOST_BOUND = 0.8


def _cell(rec: dict, key: str, fmt: str) -> str:
    value = rec.get(key)
    return "-" if value is None or value == "" else format(value, fmt)


def _ms(rec: dict) -> str:
    """The record's ms, marked † where it is host-bound (HOW_TO_READ)."""
    bound = "ms" in rec and rec.get("host_ms", 0.0) >= HOST_BOUND * rec["ms"]
    return _cell(rec, "ms", ".3f") + ("†" if bound else "")


def markdown(results: list[dict]) -> str:
    lines = ["# dmattn_cute benchmark", ""]
    for res in results:
        env = res["environment"]
        versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
        lines += [
            f"- GPU: **{env['gpu']}**, {env['date']}; {versions}; Python {env['python']}",
            f"- command: `{env['command']}` ({env.get('wall_s', '?')} s)",
            f"- timing: {env['timer']}",
        ]
        compiled = env.get("ours_compile")
        if compiled:
            lines.append(
                f"- our kernels, compiled before timing: {compiled['skipped']}"
                if "skipped" in compiled
                else f"- our kernels, compiled before timing: {compiled['variants']} variants "
                f"({compiled['compiled']} compiled, {compiled['cached']} already in the disk "
                f"cache) by {compiled['jobs']} processes in {compiled['seconds']} s"
            )
        if env.get("edited"):
            lines.append(f"- edited after the run: {env['edited']}")
    lines += ["", "How to read the tables:", "", HOW_TO_READ, "## Summary", "", summary(results)]
    lines += ["## Every measurement", ""]
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for res in results:
        for rec in res["records"]:
            groups[rec["suite"], rec["mode"]].append(rec)
    # the graph column only where a run took graph times (bench.run --graph)
    graphed = any("graph_ms" in rec for recs in groups.values() for rec in recs)
    columns = {name: col for name, col in COLUMNS.items() if graphed or col[0] != "graph_ms"}
    for (suite, mode), recs in groups.items():
        lines += [f"### {suite}, {mode}", ""]
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        skipped: dict[tuple[str, str], list[str]] = defaultdict(list)
        for rec in recs:
            if "ms" not in rec:
                reason = "; ".join(filter(None, [rec.get("skipped"), *rec.get("errors", [])]))
                skipped[rec["impl"], reason].append(rec["workload"])
                continue
            row = [_cell(rec, key, fmt) for key, fmt in columns.values()]
            lines.append("| " + " | ".join(row) + " |")
        if skipped:
            lines += ["", "Not timed:", ""]
            total = len({rec["workload"] for rec in recs})
            for (impl, reason), names in sorted(skipped.items()):
                where = "every workload" if len(names) == total else ", ".join(names)
                lines.append(f"- {impl}: {reason} ({where})")
        lines.append("")
    return "\n".join(lines)


def _peer_order(recs: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for rec in recs:
        if rec["impl"] != OURS and "ms" in rec:
            seen.setdefault(rec["impl"])
    return list(seen)


def summary(results: list[dict]) -> str:
    """One row per workload and mode: our ms and TFLOP/s, then each peer's ms and its time
    over ours (> 1: ours is faster); "-" where a peer was not timed."""
    groups: dict[tuple[str, str], dict[str, dict[str, dict]]] = defaultdict(dict)
    for res in results:
        for rec in res["records"]:
            groups[rec["suite"], rec["mode"]].setdefault(rec["workload"], {})[rec["impl"]] = rec
    lines = []
    for (suite, mode), rows in groups.items():
        peers = _peer_order([rec for row in rows.values() for rec in row.values()])
        lines += [f"### {suite}, {mode} (ms; peers: ms and time / ours)", ""]
        head = ["workload", "ours", "TFLOP/s dense-eq (executed)", *peers]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for workload, impls in rows.items():
            ours = impls.get(OURS, {})
            tflops = _cell(ours, "tflops", ".0f")
            if ours.get("executed_tflops") is not None:
                tflops += f" ({ours['executed_tflops']:.0f})"
            cells = [workload, f"**{_ms(ours)}**", tflops]
            for peer in peers:
                rec = impls.get(peer, {})
                cells.append(
                    f"{_ms(rec)} ({rec['speedup']:.2f})" if "speedup" in rec and "ms" in rec
                    else _ms(rec)
                )  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def load(path: Path) -> dict:
    """A results file of bench.run, as written (.json) or gzipped for the repository
    (.json.gz)."""
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def _timed(results: list[dict]) -> list[dict]:
    return [rec for res in results for rec in res["records"] if "ms" in rec]


def _plot_impls(ax, recs: list[dict], point) -> None:
    """One line per implementation (ours first and thicker) through point(record) = (x, y)."""
    # Sorted by name after ours: the same colours in every run (set order varies).
    for impl in sorted({r["impl"] for r in recs}, key=lambda n: (n != OURS, n)):
        pts = sorted(point(r) for r in recs if r["impl"] == impl)
        ax.plot(*zip(*pts, strict=True), marker="o", label=impl,
                linewidth=2.5 if impl == OURS else 1.2)  # fmt: skip


def _save(fig, path: Path, plotted: int) -> bool:
    import matplotlib.pyplot as plt

    if plotted:
        fig.tight_layout()
        fig.savefig(path, dpi=80)
    plt.close(fig)
    return plotted > 0


def plot_speedup_vs_density(results: list[dict], path: Path) -> bool:
    """Sparse suite: each implementation's speedup over our dense-mask time, vs density."""
    import matplotlib.pyplot as plt

    recs = [r for r in _timed(results) if r["suite"] == "sparse" and not r["causal"]]
    modes = [m for m in ("fwd", "fwdbwd") if any(r["mode"] == m for r in recs)]
    kinds = sorted({r["mask"] for r in recs})
    if not modes or not kinds:
        return False
    fig, axes = plt.subplots(len(modes), len(kinds), figsize=(5 * len(kinds), 3.6 * len(modes)),
                             squeeze=False)  # fmt: skip
    plotted = 0
    for i, mode in enumerate(modes):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            sel = [r for r in recs if r["mode"] == mode and r["mask"] == kind]
            base = [r["ms"] for r in sel if r["impl"] == OURS and r["density"] == 1.0]
            if not base:
                ax.set_visible(False)
                continue
            _plot_impls(ax, sel, lambda r, b=base[0]: (r["density"], b / r["ms"]))
            plotted += 1
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("mask density")
            ax.set_ylabel("speedup over ours at density 1")
            ax.set_title(f"{mode}, mask {kind}, bias [B,Hkv,1,Sk]")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    return _save(fig, path, plotted)


def plot_tflops_vs_seqlen(results: list[dict], path: Path, head_dim: int = 128) -> bool:
    """Dense suite: TFLOP/s vs sequence length per implementation, causal and not."""
    import matplotlib.pyplot as plt

    recs = [r for r in _timed(results)
            if r["suite"] == "dense" and r["head_dim"] == head_dim and r["dtype"] == "bf16"]  # fmt: skip
    modes = [m for m in ("fwd", "bwd", "fwdbwd") if any(r["mode"] == m for r in recs)]
    if not modes or len({r["seqlen_q"] for r in recs}) < 2:
        return False
    fig, axes = plt.subplots(len(modes), 2, figsize=(10, 3.6 * len(modes)), squeeze=False)
    plotted = 0
    for i, mode in enumerate(modes):
        for j, causal in enumerate((False, True)):
            ax = axes[i][j]
            sel = [r for r in recs if r["mode"] == mode and r["causal"] == causal]
            if not sel:
                ax.set_visible(False)
                continue
            plotted += 1
            _plot_impls(ax, sel, lambda r: (r["seqlen_q"], r["tflops"]))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length (batch x seqlen = 16k)")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{mode}, {'causal' if causal else 'not causal'}, D={head_dim} bf16")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    return _save(fig, path, plotted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument(
        "results", type=Path, nargs="+", help="results.json (or .json.gz) of bench.run"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", required=True, help="file name prefix, e.g. 2026-11-22_H200")
    args = parser.parse_args(argv)
    results = [load(p) for p in args.results]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(markdown(results))
    written = [f"{args.name}.md"]
    for suffix, plot in (("speedup_vs_density", plot_speedup_vs_density),
                         ("tflops_vs_seqlen", plot_tflops_vs_seqlen)):  # fmt: skip
        if plot(results, args.out / f"{args.name}_{suffix}.png"):
            written.append(f"{args.name}_{suffix}.png")
    print("wrote " + ", ".join(str(args.out / w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
