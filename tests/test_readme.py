"""The README's first-use instructions: the commands it gives are the ones CI and the repository
use, its links resolve inside the repository, and the torch it installs is one the package
accepts."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    """The text of the README's `## title` section."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.MULTILINE | re.DOTALL)
    assert match, f"no '## {title}' section in README.md"
    return match.group(1)


def commands(text: str) -> list[str]:
    """The commands of the indented (4-space) code lines of `text`: continuation lines joined,
    comment lines left out."""
    found, current = [], ""
    for line in text.splitlines():
        if line.startswith("    ") and not line.strip().startswith("#"):
            current += line.strip()
            if current.endswith("\\"):
                current = current[:-1]
            else:
                found.append(current)
                current = ""
    return found


def torch_requirement() -> Requirement:
    """The installed package's torch requirement (pyproject.toml's, as pip reads it)."""
    (torch_req,) = [
        Requirement(r) for r in metadata.requires("dmattn_cute") if r.startswith("torch")
    ]
    return torch_req


def test_setup_is_two_commands_install_and_run_then_test() -> None:
    install, test = commands(section("Set-up"))
    assert install.endswith('python3 -m pip install -e ".[test]" && python3 -m dmattn_cute')
    assert test == "python3 -m pytest -q"


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "python3 -m pytest -q" in ci


def test_quick_loop_deselects_the_registered_compile_marker(pytestconfig) -> None:
    assert '`python3 -m pytest -q -m "not compile"`' in section("Set-up")
    assert any(m.startswith("compile:") for m in pytestconfig.getini("markers"))


def test_torch_is_pinned_to_a_tested_range() -> None:
    spec = torch_requirement().specifier
    assert {s.operator for s in spec} == {">=", "<"}, f"torch needs both bounds, got {spec}"
    installed = Version(torch.__version__).base_version  # 2.13.0+cpu -> 2.13.0
    assert installed in spec, f"torch {torch.__version__} here, pyproject allows {spec}"
    pins = {
        "README": re.search(r"pip install torch==(\S+) --index-url \S+/whl/cpu", README),
        ".ci/run": re.search(r"pip install torch==(\S+)", (ROOT / ".ci" / "run").read_text()),
        "Dockerfile": re.search(
            r"pip install torch==(\S+)", (ROOT / "docker" / "Dockerfile").read_text()
        ),
    }
    for where, pin in pins.items():
        assert pin, f"{where} installs no pinned torch"
        assert pin.group(1) in spec, f"{where} installs torch {pin.group(1)}, outside {spec}"


def test_links_resolve_inside_the_repository() -> None:
    links = re.findall(r"\]\(([^)#\s]+)\)", README)
    local = [link for link in links if "://" not in link]
    assert "docs/SPEC.md" in local
    for link in local:
        target = (ROOT / link).resolve()
        assert target.is_relative_to(ROOT), f"{link} points outside the repository"
        assert target.exists(), f"{link} does not exist"
    assert (ROOT / "docs" / "SPEC.md").read_text().startswith("# dmattn_cute — the contract")


def test_report_command_runs_from_the_repository_root(tmp_path: Path) -> None:
    """The README's bench.report command of the committed results reproduces their tables."""
    pytest.importorskip("matplotlib")
    (command,) = [c for c in commands(section("Performance")) if "bench.report" in c and ".gz" in c]
    argv = shlex.split(command, comments=True)
    assert argv[:3] == ["python3", "-m", "bench.report"] and "cd" not in argv
    out_dir = Path(argv[argv.index("--out") + 1])
    argv[argv.index("--out") + 1] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, *argv[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    name = argv[argv.index("--name") + 1]
    assert (tmp_path / f"{name}.md").read_text() == (ROOT / out_dir / f"{name}.md").read_text()
