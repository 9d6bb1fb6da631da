"""The checkout passes ruff with the rules of pyproject.toml's ``[tool.ruff]`` (lines at most 100
characters, no unused imports or names, no undefined names), at the version pinned in
tools/constraints.txt: CI runs this as part of the README's test command."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes_on_the_whole_tree():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                             "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout}{result.stderr}"
