"""Building atom_moe: no setuptools warnings, the tuned tables shipped, no artefacts in the checkout."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_builds_without_warnings_and_ships_the_tables(tmp_path):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    src = tmp_path / "src"  # a copy: a wheel build writes build/ and *.egg-info next to pyproject.toml
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", ".*"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # setuptools' BuildBackendWarning / SetuptoolsDeprecationWarning / UserWarning lines
    backend = [line for line in (proc.stdout + proc.stderr).splitlines() if re.search(r"\w+Warning\b", line)]
    assert not backend, "\n".join(backend)
    (wheel,) = (tmp_path / "dist").glob("atom_moe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.relative_to(ROOT / "kernels").as_posix() for p in (ROOT / "kernels" / "configs").rglob("*.csv"))
    assert shipped and all(f"atom_moe/kernels/{p}" in names for p in shipped)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata


def test_editable_install_leaves_no_egg_info_in_the_checkout(tmp_path):
    """What scripts/env.sh runs (no build isolation) builds the metadata in a temporary folder."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", ".*"))
    target = tmp_path / "venv"  # a fresh venv that sees this one's packages (pip, setuptools) through a .pth
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
    py = target / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "outer.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                           "-e", str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(src.glob("*.egg-info")) and not (src / "build").exists()
