"""A sealed model directory read as the engine's `ModelFiles`, and `verify` for `tianmen unseal --verify`.

Weights decrypt chunk-parallel straight into one bytearray per file, each chunk's GCM tag checked
before anything reads it; tensors are zero-copy views of that buffer. Plaintext never touches disk.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import stat
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from security.keys import KeyProvider, KeyProviderError, provider_from_spec, spec_variables
from security.manifest import (
    HEADER,
    MANIFEST,
    Manifest,
    SealedFile,
    SealError,
    aad,
    derive_keys,
    header,
    nonce,
    sealed_size,
)
from security.safetensors_buffer import Buffer, tensors_from_buffer
from security.sm4 import KEY_SIZE, TAG_SIZE, InvalidTag, Sm4Gcm, sm3, sm4_gcm

__all__ = ["SealError", "SealedFiles", "is_sealed", "open_manifest", "verify"]

log = logging.getLogger(__name__)

MAX_MANIFEST = 64 << 20


def is_sealed(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def open_manifest(path: Path, provider: KeyProvider) -> tuple[Manifest, bytes, bytes]:
    """Reads the manifest, unwraps the data key and checks the MAC: (manifest, data key, manifest bytes)."""
    if not path.is_dir():
        raise SealError(f"{path} is not a directory")
    try:
        data = _read_regular(path / MANIFEST, MAX_MANIFEST)
    except FileNotFoundError:
        raise SealError(f"{path} is not a sealed model directory: it has no {MANIFEST}") from None
    if len(data) > MAX_MANIFEST:
        raise SealError(f"{MANIFEST} is over {MAX_MANIFEST >> 20} MiB: not a manifest Tianmen wrote")
    manifest = Manifest.loads(data)
    if manifest.key_id != provider.key_id:
        raise SealError(f"{path} is sealed under key {manifest.key_id}; the key provider holds {provider.key_id}")
    try:
        dek = provider.unwrap(manifest.wrapped_key)
    except KeyProviderError as e:
        raise SealError(f"{MANIFEST}: {e}") from None
    if len(dek) != KEY_SIZE:
        raise SealError(f"{MANIFEST}: the unwrapped data key is {len(dek)} bytes, not {KEY_SIZE}")
    manifest.check(derive_keys(dek)[1])
    return manifest, dek, data


class _Reader:
    """One sealed file, opened once: size and header checked against the manifest; chunks decrypt on demand."""

    def __init__(self, root: Path, f: SealedFile, chunk_size: int, key: bytes, cipher: Sm4Gcm) -> None:
        self.f, self.chunk_size, self._key, self._cipher = f, chunk_size, key, cipher
        try:
            self.fd = _open_regular(root / f.sealed_name)
        except FileNotFoundError:
            raise SealError(f"{f.sealed_name} is missing from {root}") from None
        try:
            size, want = os.fstat(self.fd).st_size, sealed_size(f)
            if size != want:
                how = "truncated" if size < want else "longer than sealed"
                raise SealError(f"{f.sealed_name} is {how}: {size} bytes, {MANIFEST} says {want}")
            if os.pread(self.fd, HEADER.size, 0) != header(f, chunk_size):
                raise SealError(f"{f.sealed_name}: its header does not match {MANIFEST}")
        except BaseException:
            os.close(self.fd)
            raise

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def span(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_size
        return start, min(self.chunk_size, self.f.size - start)

    def decrypt(self, index: int, out: memoryview) -> None:
        tag = bytearray(TAG_SIZE)
        where = f"{self.f.sealed_name}: chunk {index} (0-based, of {self.f.chunks})"
        if os.preadv(self.fd, [out, tag], HEADER.size + index * (self.chunk_size + TAG_SIZE)) != len(out) + TAG_SIZE:
            raise SealError(f"{where} is cut short: the file changed while being read")
        try:
            self._cipher.decrypt(self._key, nonce(self.f, index), aad(self.f, index), out, bytes(tag))
        except InvalidTag:
            raise SealError(
                f"{where} fails its integrity check: damaged, reordered, or spliced from another file"
            ) from None


class SealedFiles:
    """A sealed model directory as the engine's ModelFiles: plain names, weights decrypted in memory.

    Construction unwraps the data key, checks the manifest's MAC, every file's presence, size and header,
    and every clear file's SM3. Decryption checks each chunk's tag before the chunk is used; the whole-file
    SM3 of weights is left to `verify` unless `check_digests` (SM3 runs ~5x slower than decryption here).
    """

    def __init__(
        self,
        path: str | Path,
        provider: KeyProvider,
        *,
        threads: int | None = None,
        backend: str | None = None,
        progress: bool = False,
        check_digests: bool = False,
    ) -> None:
        self.path = Path(path)
        self._recipe: tuple[str, str, dict[str, str] | None, int] | None = None  # set by from_spec
        self.manifest, dek, raw = open_manifest(self.path, provider)
        self.digest = sm3(raw).hexdigest()  # names exactly this sealed model in logs and audit events
        self.threads = threads or default_threads()
        self.progress = progress
        self.check_digests = check_digests
        self._key = derive_keys(dek)[0]
        self._cipher = sm4_gcm(backend)
        for f in self.manifest.files.values():
            with self._reader(f):
                pass
        for name in self.manifest.clear:
            self.read(name)
        listed = {MANIFEST, *self.manifest.clear, *(f.sealed_name for f in self.manifest.files.values())}
        extra = sorted(set(os.listdir(self.path)) - listed)
        if extra:
            log.warning("%s: ignoring files not listed in %s: %s", self.path, MANIFEST, ", ".join(extra))

    @classmethod
    def from_spec(
        cls,
        path: str | Path,
        spec: str,
        environ: Mapping[str, str] | None = None,
        *,
        threads: int | None = None,
        progress: bool = False,
        digest: str | None = None,
    ) -> SealedFiles:
        """Opened with the key provider a spec names (security.keys.provider_from_spec). Such files can be copied
        to a worker process (pickle): the copy carries the spec, never key material, and reopens the directory
        there, unwrapping the data key itself (an HSM is logged into by each process). `digest`: the copy must
        find the very manifest the original opened, or SealError (files swapped in between)."""
        files = cls(path, provider_from_spec(spec, environ), threads=threads, progress=progress)
        if digest is not None and files.digest != digest:
            raise SealError(f"{files.path}: its {MANIFEST} changed after the model was opened (sm3 {digest})")
        files._recipe = (str(files.path), spec, _spec_environ(spec, environ), files.threads)
        return files

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        if self._recipe is None:
            raise TypeError(
                "sealed model files opened with a key provider object cannot be copied to another process: open "
                "them with SealedFiles.from_spec"
            )
        path, spec, environ, threads = self._recipe
        return _reopen, (path, spec, environ, threads, self.digest)

    def names(self) -> list[str]:
        return sorted([*self.manifest.files, *self.manifest.clear])

    def read(self, name: str) -> bytes:
        if name in self.manifest.files:
            return bytes(self.decrypt(name))
        entry = self.manifest.clear.get(name)
        if entry is None:
            raise FileNotFoundError(name)  # unlisted files are absent: nothing unverified gets through
        try:
            data = _read_regular(self.path / name, entry.size)
        except FileNotFoundError:
            raise SealError(f"{name} is listed in {MANIFEST} but missing from {self.path}") from None
        if len(data) != entry.size or sm3(data).hexdigest() != entry.sm3:
            raise SealError(f"{name} does not match its SM3 digest in {MANIFEST}: it was replaced or edited")
        return data

    def tensors(self, name: str) -> Iterator[tuple[str, torch.Tensor]]:
        yield from tensors_from_buffer(self.decrypt(name), name)

    def decrypt(self, name: str) -> Buffer:
        """The plaintext of one weight file, in a fresh buffer; SealError (buffer wiped) on any bad chunk."""
        f = self.manifest.files.get(name)
        if f is None:
            raise FileNotFoundError(name)
        with self._reader(f) as r:  # a missing or cut file fails here, before a buffer the size of the weights
            buf = _allocate(f.size)
            view = memoryview(buf)

            def work(index: int) -> int:
                start, n = r.span(index)
                r.decrypt(index, view[start : start + n])
                return n

            with self._bar(f.size, name) as bar, ThreadPoolExecutor(self.threads) as pool:
                try:
                    for n in pool.map(work, range(f.chunks)):
                        bar.update(n)
                    if self.check_digests and sm3(view).hexdigest() != f.sm3:
                        raise SealError(f"{name}: the decrypted weights do not match their SM3 digest in {MANIFEST}")
                except BaseException:
                    pool.shutdown(cancel_futures=True)
                    _wipe(buf)
                    raise
        return buf

    def _verify(self, f: SealedFile) -> None:
        window: deque[Future[bytearray]] = deque()
        h = sm3()

        def work(index: int) -> bytearray:
            out = bytearray(r.span(index)[1])
            r.decrypt(index, memoryview(out))
            return out

        with self._reader(f) as r, self._bar(f.size, f.name) as bar, ThreadPoolExecutor(self.threads) as pool:
            try:
                for index in range(f.chunks):
                    window.append(pool.submit(work, index))
                    while len(window) > 2 * self.threads or (window and index == f.chunks - 1):
                        chunk = window.popleft().result()
                        h.update(chunk)
                        bar.update(len(chunk))
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
        if h.hexdigest() != f.sm3:
            raise SealError(f"{f.sealed_name}: the plaintext does not match its SM3 digest in {MANIFEST}")

    def _reader(self, f: SealedFile) -> _Reader:
        return _Reader(self.path, f, self.manifest.chunk_size, self._key, self._cipher)

    def _bar(self, total: int, name: str) -> tqdm[None]:
        return tqdm(total=total, desc=name, unit="B", unit_scale=True, unit_divisor=1024, disable=not self.progress)


def _reopen(path: str, spec: str, environ: dict[str, str] | None, threads: int, digest: str) -> SealedFiles:
    return SealedFiles.from_spec(path, spec, environ, threads=threads, digest=digest)


def _spec_environ(spec: str, environ: Mapping[str, str] | None) -> dict[str, str] | None:
    """Only the variables the spec reads travel with a copy: the rest of the environment may hold other secrets,
    and a spawned worker inherits the process's own anyway."""
    if environ is None:
        return None
    return {n: environ[n] for n in spec_variables(spec) if n in environ}


def verify(
    path: str | Path,
    provider: KeyProvider,
    *,
    threads: int | None = None,
    backend: str | None = None,
    progress: bool = False,
) -> Manifest:
    """Checks the manifest, every chunk's tag and every file's SM3 without writing plaintext; SealError if not."""
    files = SealedFiles(path, provider, threads=threads, backend=backend, progress=progress)
    for f in files.manifest.files.values():
        files._verify(f)
    return files.manifest


def _open_regular(path: Path) -> int:
    """An fd on a regular file; FileNotFoundError when absent, SealError for a FIFO, directory or device."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # NOTE: a FIFO planted in the directory must not block us
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SealError(f"cannot open {path.name}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SealError(f"{path.name} is not a regular file")
    return fd


def _read_regular(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` + 1 of them however large the file has become."""
    fd = _open_regular(path)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise SealError(f"cannot read {path.name}: {e.strerror}") from None
    finally:
        os.close(fd)
    return data


def _allocate(size: int) -> Buffer:
    """Anonymous memory the kernel zero-fills on first touch, so page faults land in the decrypting threads
    rather than in a serial memset (bytearray); kept out of core dumps."""
    if not size:
        return bytearray()
    buf = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_DONTDUMP"):
        buf.madvise(mmap.MADV_DONTDUMP)
    return buf


def _wipe(buf: Buffer) -> None:
    if buf:
        ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), 0, len(buf))
