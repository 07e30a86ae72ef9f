"""SM4-GCM decryption MB/s per backend and thread count, and sealed-model load vs clear, in one run.

    python -m benchmarks.decrypt [--mb 256] [--model-mb 200] [--threads 1,2] [--repeat 3]

Raw rows decrypt 4 MiB chunks in place (best of --repeat); memcpy, SM3 and gmssl (pure Python, SM4-ECB
on 256 KB) set the scale. They measure the libgcrypt security.gcrypt picks, and the system's too when that is
another file (the bundled 1.11 of `make gcrypt` next to bookworm's 1.10). Load rows read a random ~200 MB
safetensors file into tensors: clear through safetensors, sealed through SealedFiles (unwrap + decrypt +
zero-copy views), and `verify` (+ SM3).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from security.gcrypt import Gcrypt, system_library
from security.keys import new_key_file
from security.seal import DEFAULT_CHUNK, seal
from security.sealed import SealedFiles, verify
from security.sm4 import Sm4Gcm, available_backends, sm3, sm4_gcm

KEY, NONCE, AAD = os.urandom(16), os.urandom(12), b"benchmark"
NAME = "model.safetensors"


def best(fn: Callable[[], object], repeat: int, before: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def decrypt_all(
    cipher: Sm4Gcm, view: memoryview, spans: list[tuple[int, int]], tags: list[bytes], threads: int
) -> None:
    def one(i: int) -> None:
        start, n = spans[i]
        cipher.decrypt(KEY, NONCE, AAD, view[start : start + n], tags[i])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(spans))))


def raw_rows(mb: int, threads: list[int], repeat: int) -> list[tuple[str, int, int, float]]:
    size = mb * 1_000_000 // DEFAULT_CHUNK * DEFAULT_CHUNK
    plain = os.urandom(size)
    buf = bytearray(size)
    view = memoryview(buf)
    spans = [(i, min(DEFAULT_CHUNK, size - i)) for i in range(0, size, DEFAULT_CHUNK)]
    rows = [("memcpy", 1, size, best(lambda: view.__setitem__(slice(None), plain), repeat))]
    rows.append(("SM3 (hashlib)", 1, size, best(lambda: sm3(plain).hexdigest(), repeat)))
    for label, cipher in ciphers():
        buf[:] = plain
        tags = [cipher.encrypt(KEY, NONCE, AAD, view[s : s + n]) for s, n in spans]
        sealed = bytes(buf)
        for t in threads:
            run = functools.partial(decrypt_all, cipher, view, spans, tags, t)
            restore = functools.partial(view.__setitem__, slice(None), sealed)
            rows.append((label, t, size, best(run, repeat, restore)))
            assert buf == plain
    from gmssl.sm4 import SM4_ENCRYPT, CryptSM4

    gm = CryptSM4()
    gm.set_key(KEY, SM4_ENCRYPT)
    small = plain[: 256 * 1024]
    rows.append(("SM4-ECB gmssl (pure Python)", 1, len(small), best(lambda: gm.crypt_ecb(small), 1)))
    return rows


def libraries() -> list[Gcrypt]:
    """The libgcrypt in use, then the system's when it is a different file (so both show up in one table)."""
    used = Gcrypt.load()
    if used is None:
        return []
    path = system_library()
    system = Gcrypt.from_path(path) if path else None
    if system is None or os.path.realpath(system.path) == os.path.realpath(used.path):
        return [used]
    return [used, system]


def ciphers() -> list[tuple[str, Sm4Gcm]]:
    out: list[tuple[str, Sm4Gcm]] = []
    for name in available_backends():
        if name == "gcrypt":
            libs = libraries()
            out += [(f"SM4-GCM gcrypt {lib.version}" + (" (system)" if i else ""), lib) for i, lib in enumerate(libs)]
        else:
            out.append((f"SM4-GCM {name}", sm4_gcm(name)))
    return out


def load_rows(model_mb: int, threads: list[int], repeat: int, workdir: Path) -> list[tuple[str, int, int, float]]:
    clear, sealed = workdir / "clear", workdir / "sealed"
    clear.mkdir()
    per = model_mb * 1_000_000 // 8 // 4  # 8 float32 tensors
    save_file({f"layers.{i}.w": torch.empty(per, dtype=torch.float32) for i in range(8)}, clear / "x")
    data = bytearray((clear / "x").read_bytes())
    data[-8 * per * 4 :] = os.urandom(8 * per * 4)  # random weights: nothing compresses, nothing repeats
    (clear / NAME).write_bytes(data)
    (clear / "x").unlink()
    (clear / "config.json").write_text("{}")
    kek = new_key_file(workdir / "kek")
    t = time.perf_counter()
    seal(clear, sealed, kek)
    size = len(data)
    rows = [("seal (SM3 + encrypt + write)", len(os.sched_getaffinity(0)), size, time.perf_counter() - t)]
    params = {k: torch.empty_like(t) for k, t in load_file(clear / NAME).items()}

    def into_params(tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for k, t in tensors:  # as engine.loader does: the weights end up copied into the model's parameters
            params[k].copy_(t)

    def clear_load() -> None:
        into_params(load_file(clear / NAME).items())

    rows.append(("load clear (safetensors, page cache)", 1, size, best(clear_load, repeat)))

    def sealed_load(threads: int, backend: str) -> None:
        into_params(SealedFiles(sealed, kek, threads=threads, backend=backend).tensors(NAME))

    for name in available_backends():
        for n in threads:
            rows.append((f"load sealed, {name}", n, size, best(functools.partial(sealed_load, n, name), repeat)))
    n = max(threads)
    rows.append(("verify (decrypt + SM3)", n, size, best(lambda: verify(sealed, kek, threads=n), 1)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="plaintext size for the raw rows")
    ap.add_argument("--model-mb", type=int, default=200, help="size of the safetensors file for the load rows")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the model files (default: a temp dir)")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    flags = Path("/proc/cpuinfo").read_text()
    cpu = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("model name")), "?")
    print(f"{platform.python_version()} · {cpu} · {len(os.sched_getaffinity(0))} cores")
    print(f"AVX-512: {'yes' if 'avx512' in flags else 'no'} · GFNI: {'yes' if ' gfni' in flags else 'no'}", end=" · ")
    print(f"load average {os.getloadavg()[0]:.2f}")
    libs = libraries()
    for i, lib in enumerate(libs):
        print(f"libgcrypt {lib.version} {lib.path}" + (" (system, measured for comparison)" if i else " (in use)"))
    if not libs:
        print("libgcrypt absent")
    rows = raw_rows(args.mb, threads, args.repeat)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        rows += load_rows(args.model_mb, threads, args.repeat, Path(d))
    print(f"\n{'':38}{'threads':>8}{'MB':>8}{'s':>9}{'MB/s':>9}")
    for name, t, size, secs in rows:
        rate = size / 1e6 / secs
        print(f"{name:38}{t:>8}{size / 1e6:>8.1f}{secs:>9.3f}{rate:>9.{0 if rate >= 10 else 2}f}")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
