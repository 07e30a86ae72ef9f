"""Compile a C kernel for the CPU it runs on, once, and load it with ctypes.

Kernels are built with -march=native at first use (about a second) and cached by source, compiler and CPU,
so a wheel or image never carries code tuned for another machine. No compiler means no kernel: callers keep
their plain-torch path and the engine says once why it is slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import torch  # noqa: F401  # loaded first, so the kernel's libgomp.so.1 resolves to torch's own OpenMP runtime

log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    pass


class SelfCheckError(BuildError):
    """The kernel built but gave wrong answers on this machine: it must not be used."""


K = TypeVar("K")


class Once(Generic[K]):
    """A process-wide kernel, built (and self-checked) on first use; None, with one WARNING, where it can't be."""

    def __init__(
        self,
        make: Callable[[], K],
        logger: logging.Logger,
        consequence: str,
        check: Callable[[K], None] | None = None,
    ) -> None:
        """`make` builds the kernel, `check` (raising SelfCheckError) vets it on this machine before first use."""
        self._make, self._check, self._log, self._consequence = make, check, logger, consequence
        self._lock = threading.Lock()
        self._kernel: K | None = None
        self._tried = False

    def __call__(self) -> K | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    kernel = self._make()
                    if self._check is not None:
                        self._check(kernel)
                    self._kernel = kernel
                except SelfCheckError as e:
                    self._log.warning(
                        "%s: %s. The kernel is not used; please report this with the output of lscpu.",
                        self._consequence,
                        e,
                    )
                except BuildError as e:
                    self._log.warning(
                        "%s: %s. Install a C compiler (gcc) so the engine can build its CPU kernel.",
                        self._consequence,
                        e,
                    )
            return self._kernel

    def reset(self) -> None:
        """Forget the result, so the next call builds again (tests)."""
        with self._lock:
            self._kernel, self._tried = None, False


def cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return platform.machine() + "\n" + "\n".join(sorted(set(keep)))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (x86's `flags`, aarch64's `Features`); empty where
    it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    line = next((ln for ln in lines if ln.split(":")[0].strip() in ("flags", "Features")), "")
    return frozenset(line.partition(":")[2].split())


def cache_dir() -> Path:
    explicit = os.environ.get("TIANMEN_KERNEL_CACHE")
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tianmen" / "kernels"
    for d in (Path(explicit) if explicit else home, Path(tempfile.gettempdir()) / f"tianmen-kernels-{os.getuid()}"):
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise BuildError("no writable directory for compiled kernels: set TIANMEN_KERNEL_CACHE")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def local_headers(source: Path) -> list[Path]:
    """The headers beside `source` that it includes ("name.h"), and theirs in turn: part of what a cached build
    depends on."""
    found: list[Path] = []
    todo = [source]
    while todo:
        names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', todo.pop().read_text(), flags=re.MULTILINE)
        for header in (source.with_name(n) for n in names):
            if header.is_file() and header not in found:
                found.append(header)
                todo.append(header)
    return found


def build(source: Path, flags: tuple[str, ...] = ("-march=native",)) -> ctypes.CDLL:
    """The shared library for `source` built with `flags` (+ -O3 -fopenmp), compiled now or taken from the cache."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler found (install gcc, or set CC)")
    cmd = [cc, "-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", *flags]
    texts = [source.read_text(), *(h.read_text() for h in local_headers(source))]
    key = hashlib.sha256("\0".join([*texts, *cmd, cpu_signature()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if not out.exists():
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            done = subprocess.run([*cmd, str(source), "-o", str(tmp)], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"{cc} failed to run: {e}") from None
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise BuildError(f"{cc} could not build {source.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)  # atomic: a concurrent process sees the old state or the finished library
        log.info("built CPU kernel %s", out)
    try:
        return ctypes.CDLL(str(out))
    except OSError as e:
        raise BuildError(f"cannot load {out}: {e}") from None
