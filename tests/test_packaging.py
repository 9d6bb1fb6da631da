"""The wheel holds the library only: every module of ``core`` but the test and measurement
harnesses of ``core.testing``, which stay in the checkout (the tests, examples and tools import
them from there), and no tests/, tools/ or examples/."""

import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY_PACKAGES = ("core", "core/fusions", "core/models", "core/ssm", "core/training",
                    "core/transformer")
# What a checkout may hold besides its sources (the venv, build output, caches).
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", ".whl", "build", "*.egg-info",
                                     "__pycache__", ".pytest_cache", "runs", "out", ".site")


def _build_wheel(tmp_path: Path) -> list:
    """The names in the wheel that ``pip wheel`` builds from a copy of the checkout (a copy:
    setuptools builds in the source tree, and a stale build/ there would enter the wheel)."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
               "--disable-pip-version-check", "--wheel-dir", str(tmp_path / "wheel"), str(source)]
    if importlib.util.find_spec("setuptools") is not None:  # else pip fetches the backend
        command.append("--no-build-isolation")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_wheel_holds_the_library_and_not_the_harnesses(tmp_path):
    names = _build_wheel(tmp_path)
    top_level = {name.split("/")[0] for name in names}
    dist_info = {name for name in top_level if name.endswith(".dist-info")}
    assert len(dist_info) == 1 and top_level - dist_info == {"core"}, top_level
    assert not [name for name in names if name.startswith("core/testing/")]
    for package in LIBRARY_PACKAGES:
        assert f"{package}/__init__.py" in names, package
    library = {path.relative_to(ROOT).as_posix() for path in (ROOT / "core").rglob("*.py")
               if "__pycache__" not in path.parts and path.parent.name != "testing"}
    assert library <= set(names), sorted(library - set(names))


def test_the_library_imports_no_harness():
    """What the wheel installs must import without core.testing, which it does not hold."""
    harness_import = re.compile(r"^\s*(from|import)\s+core\.testing\b", re.MULTILINE)
    offenders = [path.relative_to(ROOT).as_posix() for path in (ROOT / "core").rglob("*.py")
                 if path.parent.name != "testing" and harness_import.search(path.read_text())]
    assert not offenders

