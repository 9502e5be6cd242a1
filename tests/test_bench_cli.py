"""The benchmark without a GPU: its command line, workloads, inputs, the peers' semantics (SDPA
math on CPU against ours), the executed-tile count, and the report's tables and plots."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import peers, report, run
from bench.workloads import BLOCK_K, BLOCK_Q, HEADS_KV, SUITES, Workload, make_inputs

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_help_and_list() -> None:
    assert "--quick" in _cli("--help")
    quick = _cli("--quick", "--list").strip().splitlines()
    assert quick[-1] == f"{len(quick) - 1} runs"
    assert {line.split()[0] for line in quick[:-1]} == {"dense", "bias", "sparse", "decode"}
    full = _cli("--list").strip().splitlines()
    decode = [line for line in full if line.startswith("decode")]
    assert decode and all(line.split()[1] == "fwd" for line in decode)
    assert any("Sk524288" in line for line in decode)
    only = _cli("--suites", "dense", "--modes", "bwd", "--only", "^S2048 D128 bf16( causal)?$",
                "--list").strip().splitlines()  # fmt: skip
    assert only == ["dense   bwd    S2048 D128 bf16", "dense   bwd    S2048 D128 bf16 causal",
                    "2 runs"]  # fmt: skip


def test_suites_cover_the_issue() -> None:
    dense = SUITES["dense"]()
    assert {w.head_dim for w in dense} == {64, 128, 256}
    assert {w.seqlen_q for w in dense} == {1024, 2048, 4096, 8192, 16384}
    assert {w.dtype for w in dense} == {"bf16", "fp16"} and {w.causal for w in dense} == {0, 1}
    bias = SUITES["bias"]()
    assert {w.bias for w in bias} == {"key", "full", None}
    # the price of the bias alone: the same shape without it, and with no mask
    assert {(w.bias, w.mask) for w in bias if w.mask is None} == {(None, None), ("key", None)}
    sparse = SUITES["sparse"]()
    assert {(w.mask, w.density) for w in sparse} == {
        (kind, p) for kind in ("blocks", "blocks128", "topk") for p in (1.0, 0.5, 0.25, 0.1, 0.05)
    }
    assert {w.seqlen_q for w in SUITES["decode"]()} == {1}


def _small(mask, density=1.0, bias="key", causal=False, sq=256, sk=320):
    return Workload("sparse", 2, sq, sk, 32, causal=causal, bias=bias, mask=mask, density=density)


def test_block_mask_inputs() -> None:
    w = _small("blocks", 0.3)
    x = make_inputs(w, "cpu")
    assert x.mask.shape == (2, HEADS_KV, 256, 320) and x.mask.dtype == torch.bool
    blocks = x.mask.view(2, HEADS_KV, 256 // BLOCK_Q, BLOCK_Q, 320 // BLOCK_K, BLOCK_K)
    # Constant over each block, and every query block keeps at least one key block.
    assert torch.equal(blocks.any(5).any(3), blocks.all(5).all(3))
    assert blocks.any(5).any(3).any(3).all()
    assert x.bias.shape == (2, HEADS_KV, 1, 320)


@pytest.mark.parametrize("density", [0.05, 0.25, 1.0])
def test_block_mask_density_is_the_visible_fraction(density: float) -> None:
    """The kept block of every query row counts toward the density: at S4096, 128 x 128
    blocks, the visible fraction is density (not density + (1 - density) / 32)."""
    w = Workload("sparse", 8, 4096, 4096, bias="key", mask="blocks128", density=density)
    blocks = make_inputs(w, "cpu").blocks  # 8 x 4 x 32 rows of 32 blocks
    assert abs(blocks.float().mean().item() - density) < 0.01
    assert blocks.any(3).all()


def test_block_mask_128_inputs_carry_their_blocks() -> None:
    """blocks128: the element mask is the blocks repeated, and ours_block_mask (the blocks as
    block_mask=) computes what ours computes with the element mask."""
    w = _small("blocks128", 0.4, causal=True, sq=300, sk=520)
    x = make_inputs(w, "cpu")
    assert x.blocks.shape == (2, HEADS_KV, 3, 5)
    expanded = x.blocks.repeat_interleave(128, 2).repeat_interleave(128, 3)[:, :, :300, :520]
    assert torch.equal(x.mask, expanded)
    (_, ours_call), = peers.ours(x)  # fmt: skip
    (_, blocks_call), = peers.ours_block_mask(x)  # fmt: skip
    with torch.no_grad():
        assert torch.equal(blocks_call(), ours_call())
    with pytest.raises(peers.Unsupported, match="128 x 128 blocks"):
        next(peers.ours_block_mask(make_inputs(_small("blocks", 0.4), "cpu")))


def test_topk_mask_inputs() -> None:
    w = _small("topk", 0.25, causal=True)
    x = make_inputs(w, "cpu")
    keep = round(0.25 * 320)
    counts = x.mask.sum(-1)
    assert counts.max() == keep and counts.min() >= 1
    # Causal (bottom-right aligned): query i sees keys <= i + Sk - Sq only.
    cols = torch.arange(320)
    rows = torch.arange(256)[:, None] + 64
    assert not (x.mask & (cols > rows)).any()


@pytest.mark.parametrize(
    "w",
    [
        _small("blocks", 0.5),
        _small("topk", 0.25, causal=True),
        _small("dense", bias="full"),
        _small(None, bias=None, causal=True, sq=320, sk=320),
        Workload("decode", 2, 1, 640, 32, bias="key", mask="blocks", density=0.25),
    ],
    ids=lambda w: w.name,
)
def test_peer_semantics_match_ours(w: Workload) -> None:
    """SDPA math (the peers' shared float mask) computes what ours computes (CPU reference)."""
    x = make_inputs(w, "cpu")
    (_, ours_call), = peers.ours(x)  # fmt: skip
    (_, math_call), = peers.sdpa_math(x)  # fmt: skip
    with torch.no_grad():
        got, ref = math_call().float(), ours_call().float()
    assert (got - ref).norm() / ref.norm() < 2e-2


def test_unsupported_peers_say_why() -> None:
    x = make_inputs(_small("blocks", 0.5), "cpu")
    with pytest.raises(peers.Unsupported, match="no mask or bias"):
        next(peers.sdpa_flash(x))
    with pytest.raises(peers.Unsupported, match="not installed"):
        next(peers.flash_dmattn(x))


def test_executed_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMATTN_CUTE_ARCH", "sm_90a")
    full = _small("blocks", 1.0, sq=512, sk=512)
    assert run.executed_fraction(full, make_inputs(full, "cpu"), "fwd") == pytest.approx(1.0)
    sparse = _small("blocks", 0.25, sq=512, sk=512)
    fraction = run.executed_fraction(sparse, make_inputs(sparse, "cpu"), "fwdbwd")
    assert 0.1 < fraction < 0.8
    dense = _small("dense")
    assert run.executed_fraction(dense, make_inputs(dense, "cpu"), "fwd") is None
    # One query row: tiles count their real rows only.
    decode = Workload("decode", 2, 1, 640, 32, bias="key", mask="blocks", density=1.0)
    assert run.executed_fraction(decode, make_inputs(decode, "cpu"), "fwd") == pytest.approx(1.0)


def test_gpu_state_is_nvidia_smis_line_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def smi(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "1980 MHz, 2619 MHz, 45, 300.50 W, 0x0\n", "")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(run.subprocess, "run", smi)
    assert run.gpu_state() == "1980 MHz, 2619 MHz, 45, 300.50 W, 0x0"
    assert "--id=3" in calls[0] and f"--query-gpu={run.GPU_STATE_QUERY}" in calls[0]

    def missing(argv, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(run.subprocess, "run", missing)
    assert run.gpu_state() is None


def test_our_variants_are_what_the_runs_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMATTN_CUTE_ARCH", "sm_90a")
    dense, plain = _small("dense"), _small(None, bias=None)
    causal, blocks, topk = (
        _small("dense", causal=True),
        _small("blocks", 0.25),
        _small("topk", 0.25),
    )
    # with a mask, the Hopper forward and backward first run the block-bits pre-pass (each
    # for its own tiles, and the eager training path one for both); the forward's bf16 key
    # bias, the terms pre-pass
    fwd_only = run.our_variants([(dense, "fwd")], "cpu", "sm_90a")
    assert [label.split()[0] for label, _ in fwd_only] == ["fwd", "terms", "bits"]
    both = run.our_variants([(dense, "fwd"), (dense, "fwdbwd")], "cpu", "sm_90a")
    kinds = [label.split()[0] for label, _ in both]
    assert kinds == ["fwd", "terms", "bits", "bwd_pre", "bwd", "bits", "bits"]
    assert both[0][1] == fwd_only[0][1]
    # The causal flag and the operands make other kernels; the mask's contents do not.
    more = run.our_variants(
        [(w, "fwdbwd") for w in (dense, plain, causal, blocks, topk)], "cpu", "sm_90a"
    )
    assert {spec for _, spec in both} < {spec for _, spec in more}
    assert sorted(label for label, _ in more if label.startswith("fwd ")) == sorted(
        f"fwd {w.name}" for w in (dense, plain, causal)
    )


def _record(suite, mode, impl, ms, **extra) -> dict:
    w = extra.pop("w", Workload(suite, 2, 4096, 4096))
    return {"workload": w.name, **w.__dict__, "mode": mode, "impl": impl, "ms": ms,
            "tflops": w.flops() / ms * 1e-9, **extra}  # fmt: skip


def test_report_tables_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = []
    for p in (1.0, 0.5, 0.25, 0.1, 0.05):
        w = Workload("sparse", 2, 4096, 4096, bias="key", mask="blocks", density=p)
        records += [_record("sparse", "fwd", "ours", 1.0 * p + 0.1, w=w),
                    _record("sparse", "fwd", "flex", 0.8 * p + 0.1, w=w)]  # fmt: skip
    for s in (1024, 2048, 4096):
        w = Workload("dense", 16384 // s, s, s)
        records += [_record("dense", "fwd", "ours", s / 1000, w=w),
                    _record("dense", "fwd", "sdpa_flash", s / 900, w=w)]  # fmt: skip
    for rec in records:
        rec["speedup"] = rec["ms"] / next(
            r["ms"] for r in records if r["workload"] == rec["workload"] and r["impl"] == "ours"
        )
    for rec in records:  # host-bound: S2048's peer (within 0.8 of its ms), not S1024's
        if rec["workload"].startswith("S2048") and rec["impl"] == "sdpa_flash":
            rec["host_ms"] = 0.9 * rec["ms"]
        elif rec["workload"].startswith("S1024"):
            rec["host_ms"] = 0.7 * rec["ms"]
    records[0]["graph_ms"] = 0.987  # bench.run --graph
    records.append({**_record("dense", "fwd", "fa4", 1.0), "skipped": "not installed"})
    del records[-1]["ms"]
    env = {"gpu": "Test GPU", "date": "2026-11-22 00:00 UTC", "versions": {"torch": "x"},
           "python": "3", "command": "python3 -m bench.run", "timer": "t",
           "ours_compile": {"variants": 3, "compiled": 2, "cached": 1, "jobs": 2, "seconds": 9.5}}  # fmt: skip
    path = tmp_path / "results.json.gz"  # committed results are gzipped
    path.write_bytes(gzip.compress(json.dumps({"environment": env, "records": records}).encode()))
    assert report.main([str(path), "--out", str(tmp_path), "--name", "r"]) == 0
    text = (tmp_path / "r.md").read_text()
    assert "## sparse, fwd" in text and "## dense, fwd" in text and "Test GPU" in text
    assert "| graph ms |" in text and text.count("| 0.987 |") == 1
    assert "- fa4: not installed (S4096 D128 bf16)" in text
    # Summary: one row per workload, ours first, each peer's ms and time over ours.
    assert "### dense, fwd (ms; peers: ms and time / ours)" in text
    assert "| S1024 D128 bf16 | **1.024** | 134 | 1.138 (1.11) |" in text
    assert "| S2048 D128 bf16 | **2.048** | 134 | 2.276† (1.11) |" in text
    assert "3 variants (2 compiled, 1 already in the disk cache) by 2 processes in 9.5 s" in text
    for name in ("r_speedup_vs_density.png", "r_tflops_vs_seqlen.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_varlen_bench_layouts_hold_the_same_sequences() -> None:
    """bench.varlen's padded batch and packed tokens: the same outputs on the real rows and
    the same bias gradient on the real keys (CPU: the reference path of both APIs)."""
    from bench.varlen import make_layouts, sequence_lengths

    assert sequence_lengths(4096, 8) == [4096 - 256 * i for i in range(8)]
    starts = torch.tensor(sequence_lengths(4096, 8, unaligned=True)).cumsum(0)[:-1]
    assert (starts % 128 != 0).all()
    lay = make_layouts([7, 3, 5], 4, 2, 32, "cpu", torch.bfloat16)
    assert lay.cu_seqlens.tolist() == [0, 7, 10, 15] and int(lay.valid.sum()) == 15
    for causal in (False, True):
        padded, packed = lay.padded_call(causal), lay.packed_call(causal)
        torch.testing.assert_close(packed, padded[lay.valid])
        # padding query rows see the real keys too: their gradient must not count
        dout = torch.randn_like(padded) * lay.valid[:, :, None, None]
        bias_padded = torch.autograd.grad(padded, lay.padded[4], dout)[0]
        bias_packed = torch.autograd.grad(packed, lay.packed[3], dout[lay.valid])[0]
        torch.testing.assert_close(bias_packed, bias_padded[:, :, 0].transpose(0, 1)[:, lay.valid])


def test_decode_layers_count_the_visible_tiles_bytes(monkeypatch) -> None:
    """bench.decode_layers' traffic: K and V rows of every key tile (64 keys, as sm_90a plans
    a decode step with a mask) with a visible key, the tail tile's real keys only."""
    from bench.decode_layers import visible_kv_bytes, workload
    from dmattn_cute.jit import ARCH_ENV

    monkeypatch.setenv(ARCH_ENV, "sm_90a")

    assert workload(32768).name == next(
        w.name for w in SUITES["decode"]() if w.seqlen_k == 32768 and w.mask == "blocks"
    )
    w = Workload("decode", 2, 1, 200, 32, bias="key", mask="blocks", density=0.25)
    x = make_inputs(w, device="cpu")
    x.mask[0, 0] = False
    x.mask[0, 0, 0, 3] = True  # block 0: 64 keys
    x.mask[0, 0, 0, 199] = True  # block 3, the tail: 8 keys
    keys = 64 + 8
    for b in range(2):
        for h in range(HEADS_KV):
            for start in range(0, 200, 64):
                if (b, h) != (0, 0) and x.mask[b, h, 0, start : start + 64].any():
                    keys += min(64, 200 - start)
    assert visible_kv_bytes(w, x) == keys * 2 * 32 * 2


def test_heads_major_kv_inputs_are_transformers_cache_views() -> None:
    w = Workload("decode", 2, 1, 64, 32, heads_major_kv=True)
    x = make_inputs(w, device="cpu")
    assert "kv heads-major" in w.name
    for t in (x.k, x.v):
        assert t.shape == (2, 64, HEADS_KV, 32) and t.stride()[1:] == (32, 64 * 32, 1)
    assert any(w.heads_major_kv for w in SUITES["decode"]())


def test_peer_forward_reports_a_peer_that_does_not_run(tmp_path, capsys) -> None:
    def fails():
        raise RuntimeError("out of memory\nmore")

    result = {"gpu": "none"}
    run.peer_forward(result, "flex", fails, torch.zeros(2))
    assert result == {"gpu": "none", "flex_fwd_error": "RuntimeError: out of memory"}
    run.write_result(result, str(tmp_path / "out"), "x.json")
    assert json.loads((tmp_path / "out" / "x.json").read_text()) == result
    assert json.loads(capsys.readouterr().out) == result


def test_branches_builds_patched_trees_without_tests(tmp_path: Path) -> None:
    """bench/branches.sh --no-tests: one tree per .patches/<name>.patch, patched, no pytest
    run; a patch that does not apply fails the script."""
    root = Path(__file__).resolve().parents[1]
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("dmattn_cute", "bench", "tests", "examples"):
        (repo / name).mkdir()
    for name in ("pyproject.toml", "README.md"):
        (repo / name).write_text("")
    (repo / "dmattn_cute" / "k.py").write_text("STAGES = 2\n")
    for script in ("branches.sh", "carried.sh"):
        (repo / "bench" / script).write_text((root / "bench" / script).read_text())
    patches = repo / ".patches"
    patches.mkdir()
    hunk = "@@ -1 +1 @@\n-STAGES = {}\n+STAGES = 3\n"
    (patches / "three.patch").write_text(
        "--- a/dmattn_cute/k.py\n+++ b/dmattn_cute/k.py\n" + hunk.format(2)
    )
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    result = subprocess.run(
        ["bash", "bench/branches.sh", "--no-tests"], check=False, cwd=repo, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert (repo / ".branches/three/dmattn_cute/k.py").read_text() == "STAGES = 3\n"
    assert (repo / "dmattn_cute/k.py").read_text() == "STAGES = 2\n"
    assert not list((tmp_path / "out").glob("branch_*.log"))  # no pytest ran

    (patches / "stale.patch").write_text(
        "--- a/dmattn_cute/k.py\n+++ b/dmattn_cute/k.py\n" + hunk.format(5)
    )
    result = subprocess.run(
        ["bash", "bench/branches.sh", "--no-tests"], check=False, cwd=repo, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1 and "stale: the patch does not apply" in result.stdout


def test_ab_runs_a_probe_in_every_tree_in_both_orders(tmp_path: Path) -> None:
    """bench/ab.sh with AB_PROBE: the probe runs from each tree's root (this one and every
    .branches/<name>), every other round in reverse order, each output kept whole."""
    root = Path(__file__).resolve().parents[1]
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    for script in ("ab.sh", "carried.sh"):
        (repo / "bench" / script).write_text((root / "bench" / script).read_text())
    (repo / ".branches" / "three").mkdir(parents=True)
    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys\nprint(os.path.basename(os.getcwd()), *sys.argv[1:])\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "AB_PROBE": str(probe), "AB_ROUNDS": "2"}
    result = subprocess.run(
        ["bash", "bench/ab.sh", "8"], check=False, cwd=repo, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    order = [line[3:] for line in result.stdout.splitlines() if line.startswith("== ")]
    assert order == ["root_r1", "three_r1", "three_r2", "root_r2"]
    assert (out / "probe_root_r2.log").read_text() == "repo 8\n"
    assert (out / "probe_three_r1.log").read_text() == "three 8\n"
    assert not list(out.glob("ab_*"))  # no benchmark ran
