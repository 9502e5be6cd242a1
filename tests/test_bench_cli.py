"""The benchmark's command line answers --help on a machine without a GPU."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_help_lists_quick() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout
