"""`seal` a HuggingFace model directory under a key provider, and `rewrap` its data key under another.

Sealing writes into a hidden sibling directory and renames it into place when complete, so a crash
never leaves a half-sealed model that looks whole.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from security.keys import KeyProvider, KeyProviderError
from security.manifest import (
    FILE_ID_SIZE,
    MANIFEST,
    MAX_CHUNK,
    MIN_CHUNK,
    SUFFIX,
    ClearFile,
    Manifest,
    SealedFile,
    SealError,
    aad,
    derive_keys,
    header,
    nonce,
    num_chunks,
)
from security.sealed import default_threads, open_manifest
from security.sm4 import KEY_SIZE, Sm4Gcm, sm3, sm4_gcm

__all__ = ["DEFAULT_CHUNK", "SealError", "rewrap", "seal"]

DEFAULT_CHUNK = 4 << 20
# Weights in formats we do not encrypt: sealing would leave them in clear, so it refuses instead.
CLEAR_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz", ".npy", ".onnx", ".pkl")


def seal(
    src: str | Path,
    dst: str | Path,
    provider: KeyProvider,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    progress: bool = False,
    threads: int | None = None,
    backend: str | None = None,
) -> Manifest:
    """Seals `src` into `dst` (absent or empty) under a fresh data key wrapped by `provider`."""
    src, dst = Path(src), Path(dst)
    if not MIN_CHUNK <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size must be in [{MIN_CHUNK}, {MAX_CHUNK}]; got {chunk_size}")
    weights, clear = _plan(src)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise SealError(f"{dst} already exists and is not an empty directory")
    dek = os.urandom(KEY_SIZE)
    wrapped = _wrap(provider, dek)
    key, mac_key = derive_keys(dek)
    cipher, threads = sm4_gcm(backend), threads or default_threads()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.sealing-", dir=dst.parent))
    try:
        files: dict[str, SealedFile] = {}
        total = sum(p.stat().st_size for p in weights)
        with tqdm(
            total=total, desc="sealing", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress
        ) as bar:
            for p in weights:
                file_id = os.urandom(FILE_ID_SIZE)
                while file_id in {f.file_id for f in files.values()}:
                    file_id = os.urandom(FILE_ID_SIZE)
                files[p.name] = _seal_file(p, tmp, file_id, chunk_size, key, cipher, threads, bar)
        manifest = Manifest(chunk_size, provider.kind, provider.key_id, wrapped, files, {})
        manifest.clear = {p.name: _copy_clear(p, tmp) for p in clear}
        manifest.sign(mac_key)
        Manifest.loads(manifest.dumps()).check(mac_key)  # the reader accepts what we wrote (file names included)
        _write(tmp / MANIFEST, manifest.dumps())
        os.chmod(tmp, 0o755)
        _fsync_dir(tmp)
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def rewrap(path: str | Path, old: KeyProvider, new: KeyProvider) -> Manifest:
    """Moves a sealed model to a new KEK: rewraps the data key and re-MACs the manifest; weights stay as they are."""
    path = Path(path)
    manifest, dek, _ = open_manifest(path, old)
    manifest.wrapped_key = _wrap(new, dek)
    manifest.provider, manifest.key_id = new.kind, new.key_id
    manifest.sign(derive_keys(dek)[1])
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", dir=path)
    try:
        os.close(fd)
        _write(Path(tmp), manifest.dumps())
        os.replace(tmp, path / MANIFEST)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path)
    return manifest


def _plan(src: Path) -> tuple[list[Path], list[Path]]:
    if not src.is_dir():
        raise SealError(f"{src} is not a directory")
    if (src / MANIFEST).exists():
        raise SealError(f"{src} is already sealed")
    weights, clear, refused = [], [], []
    for p in sorted(src.iterdir()):
        if p.name.startswith("."):
            continue  # .gitattributes, .cache/: not part of the model
        if not p.is_file():
            refused.append(p.name + "/" if p.is_dir() else p.name)
        elif p.name.endswith(".safetensors"):
            weights.append(p)
        elif p.name.endswith((*CLEAR_WEIGHT_SUFFIXES, SUFFIX)):
            refused.append(p.name)
        else:
            clear.append(p)
    if refused:
        raise SealError(
            f"{src} holds {', '.join(refused)}: seal encrypts only top-level *.safetensors and copies other "
            "files in clear, so it refuses weights in other formats and subdirectories; remove or convert them"
        )
    if not weights:
        raise SealError(f"{src} has no *.safetensors weights to seal")
    return weights, clear


def _wrap(provider: KeyProvider, dek: bytes) -> bytes:
    try:
        wrapped = provider.wrap(dek)
        if provider.unwrap(wrapped) != dek:  # a broken provider must fail here, not after sealing 100 GB
            raise KeyProviderError(f"{provider.key_id} does not unwrap what it wraps")
    except KeyProviderError as e:
        raise SealError(f"cannot wrap the data key: {e}") from None
    return wrapped


def _seal_file(
    src: Path, dst_dir: Path, file_id: bytes, chunk_size: int, key: bytes, cipher: Sm4Gcm, threads: int, bar: tqdm[None]
) -> SealedFile:
    with open(src, "rb") as fin:
        size = os.fstat(fin.fileno()).st_size
        f = SealedFile(src.name, file_id, size, num_chunks(size, chunk_size), "")
        h = sm3()
        window: deque[tuple[Future[bytes], bytearray]] = deque()
        with open(dst_dir / f.sealed_name, "xb") as fout, ThreadPoolExecutor(threads) as pool:
            fout.write(header(f, chunk_size))
            for index in range(f.chunks):
                chunk = bytearray(min(chunk_size, size - index * chunk_size))
                if fin.readinto(chunk) != len(chunk):
                    raise SealError(f"{src} shrank while being sealed")
                h.update(chunk)  # NOTE: before the in-place encryption below
                window.append(
                    (pool.submit(cipher.encrypt, key, nonce(f, index), aad(f, index), memoryview(chunk)), chunk)
                )
                while len(window) > 2 * threads or (window and index == f.chunks - 1):
                    _flush(window.popleft(), fout, bar)
            if fin.read(1):
                raise SealError(f"{src} grew while being sealed")
            fout.flush()
            os.fsync(fout.fileno())
    return replace(f, sm3=h.hexdigest())


def _flush(item: tuple[Future[bytes], bytearray], out: BinaryIO, bar: tqdm[None]) -> None:
    future, chunk = item
    tag = future.result()
    out.write(chunk)
    out.write(tag)
    bar.update(len(chunk))


def _copy_clear(src: Path, dst_dir: Path) -> ClearFile:
    data = src.read_bytes()
    _write(dst_dir / src.name, data)
    return ClearFile(src.name, len(data), sm3(data).hexdigest())


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, 0o644)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
