"""Lint and format: ``ruff check`` and ``ruff format --check`` (pyproject.toml's ``[tool.ruff]``) are
clean on the tree, so CI (``make test``) runs the linter; ``make lint`` runs the same two commands.
Fix with ``.venv/bin/ruff format .`` and ``.venv/bin/ruff check --fix .``."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOWN = 40  # findings printed on failure


def _ruff() -> str:
    """The venv's ruff (next to this interpreter; the dev group pins it), else one on PATH."""
    here = Path(sys.executable).parent / "ruff"
    found = str(here) if here.is_file() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: run `make setup` (pyproject.toml's dev group pins it)")
    return found


@pytest.mark.parametrize(
    "args",
    [["check", "--output-format", "concise", "--no-fix"], ["format", "--check"]],
    ids=["check", "format"],
)
def test_ruff_is_clean(args):
    proc = subprocess.run(
        [_ruff(), *args, "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )
    findings = (proc.stdout + proc.stderr).strip().splitlines()
    shown = "\n".join(findings[:SHOWN])
    if len(findings) > SHOWN:
        shown += f"\n… and {len(findings) - SHOWN} more lines"
    assert proc.returncode == 0, f"`ruff {' '.join(args)} .` is not clean (fix: see this module's docstring):\n{shown}"
