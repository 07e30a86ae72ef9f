"""llama.cpp as a peer of benchmarks.throughput (--llamacpp DIR): the same shape, exported to GGUF
(benchmarks.gguf_export), quantized with llama.cpp's own llama-quantize, run by its llama-batched-bench.

DIR holds llama.cpp's binaries, built from source (docs/PERFORMANCE.md says how). Its figures map onto ours:
batch tok/s = B x TG tokens over the whole run (prefill included), batch-1 ms/token = T_TG / TG at B = 1.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from benchmarks.gguf_export import export_gguf
from benchmarks.shapes import SHAPES, checkpoint

# our scheme → llama.cpp's nearest type: Q8_0 is int8 in blocks of 32 with an f16 scale each, and its CPU code
# quantizes the activations to int8 blocks of 32 too (W8A8 quantizes them per token); Q4_0 is 4-bit symmetric in
# blocks of 32 (W4A16 with --group-size 32), its activations quantized to int8 blocks as well (W4A16 keeps bf16)
TYPES = {"bf16": "BF16", "w8a8": "Q8_0", "w4a16": "Q4_0"}


def gguf_file(bin_dir: Path, shape: str, kind: str) -> Path:
    """The shape as a GGUF of llama.cpp type TYPES[kind], made once beside its checkpoint."""
    src = checkpoint(shape)
    f16 = src.with_name(f"{shape}-f16.gguf")
    if not f16.exists():
        export_gguf(src, f16, SHAPES[shape])
    out = src.with_name(f"{shape}-{TYPES[kind].lower()}.gguf")
    if not out.exists():
        tmp = out.with_suffix(".partial")
        done = subprocess.run(
            [str(bin_dir / "llama-quantize"), str(f16), str(tmp), TYPES[kind], str(_threads())],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize exit {done.returncode}: {done.stderr.strip()[-300:]}")
        tmp.rename(out)
    return out


def llamacpp(bin_dir: str, shape: str, kind: str, prompt_len: int, output_len: int, batch: int) -> tuple[float, float]:
    """(batch tok/s, batch-1 ms/token) of llama-batched-bench at B = batch and B = 1."""
    model = gguf_file(Path(bin_dir), shape, kind)
    per_seq = prompt_len + output_len + 32
    cmd = [
        str(Path(bin_dir) / "llama-batched-bench"),
        "-m", str(model),
        "-c", str(per_seq * max(batch, 1)),
        "-b", "2048",
        "-ub", "512",
        "-npp", str(prompt_len),
        "-ntg", str(output_len),
        "-npl", f"1,{batch}",
        "-t", str(_threads()),
        "-tb", str(_threads()),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = parse(done.stdout)
    if done.returncode != 0 or {1, batch} - rows.keys():
        raise RuntimeError(f"llama-batched-bench exit {done.returncode}: {done.stderr.strip()[-300:]}")
    b = rows[batch]
    return b["B"] * b["TG"] / b["T"], rows[1]["T_TG"] / rows[1]["TG"] * 1e3


def parse(table: str) -> dict[int, dict[str, float]]:
    """llama-batched-bench's markdown table → {B: {column: value}}."""
    header: list[str] = []
    out: dict[int, dict[str, float]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or len(cells) < 10:
            continue
        if cells[0] == "PP":
            header = [c.removesuffix(" s").removesuffix(" t/s").strip() for c in cells]
            continue
        if header and cells[0].isdigit():
            row = dict(zip(header, (float(c) for c in cells), strict=True))
            out[int(row["B"])] = row
    return out


def version(bin_dir: str) -> str:
    done = subprocess.run(
        [str(Path(bin_dir) / "llama-batched-bench"), "--version"], capture_output=True, text=True, check=False
    )
    text = (done.stdout + done.stderr).strip().splitlines()
    line = next((ln for ln in text if ln.startswith("version")), "")
    return line.rpartition("commit ")[2].rstrip(")") or "?"  # the source's commit: builds from tarballs number 1


def _threads() -> int:
    return len(os.sched_getaffinity(0))
