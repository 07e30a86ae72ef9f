"""The installed package, as the Docker image has it (`pip install /src`, not editable): the kernels compile from
what the wheel carries. WHY: package-data listed the C sources only, so in the image every kernel that includes a
header of ours (18 of the 20; not the program executor or the grammar bitmask) failed to build, and the engine
ran on oneDNN and torch alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from engine.kernels.cbuild import compiler, local_headers

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "engine", "security", "audit")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the sources (the build writes build/ and egg-info beside them), with this
    environment's setuptools: no network."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return next(out.glob("tianmen-*.whl"))


def test_the_wheel_carries_every_kernel_source_and_every_header_they_include(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = ROOT / "engine" / "kernels"
    needed = {p.name for c in kernels.glob("*.c") for p in (c, *local_headers(c))}
    assert len(needed) > len(list(kernels.glob("*.c")))  # (headers are among them)
    assert sorted(n for n in needed if f"engine/kernels/{n}" not in names) == []


def test_a_kernel_with_headers_builds_from_the_installed_package(wheel: Path, tmp_path: Path) -> None:
    """pointwise.c (vec16.h) compiled and self-checked by the installed copy, in a process that cannot see this
    checkout's sources."""
    if compiler() is None:
        pytest.skip("no C compiler here")
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    code = (
        "import engine.kernels.pointwise as p, pathlib; "
        f"assert pathlib.Path(p.__file__).is_relative_to({str(site)!r}), p.__file__; "
        "assert p.kernel() is not None, 'pointwise.c did not build from the installed package'"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "TIANMEN_KERNEL_CACHE": str(tmp_path / "kernels")}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
