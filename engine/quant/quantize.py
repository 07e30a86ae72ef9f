"""`tianmen quantize`: a bf16/fp32 HuggingFace directory → a compressed-tensors checkpoint (what llm-compressor
writes and vLLM loads), by round-to-nearest: per-channel symmetric int8 (W8A8, activations quantized per token
at run time) or per-group symmetric 4-bit (W4A16). Embeddings, norms, MoE routers and (unless asked) the LM head
stay as they are. `tianmen-quant.json` records what was done."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.errors import ModelLoadError
from engine.loader import INDEX, DirectoryFiles, read_json, weight_files
from engine.quant.weights import pack_nibbles

SCHEMES = ("w8a8", "w4a16")
ROUTERS = ("gate", "router")  # a MoE layer's expert choice: small, and sensitive to rounding
SHARD_BYTES = 2 << 30
CT_VERSION = "0.20.1"  # the compressed-tensors release whose config this mirrors


@dataclass(slots=True)
class QuantizeReport:
    """What `quantize` did (written as tianmen-quant.json)."""

    scheme: str
    group_size: int | None
    method: str = "rtn"
    symmetric: bool = True
    smooth_alpha: float | None = None
    quantized: int = 0
    kept: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0


def rtn_int8(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] → int8 [N, K] and its per-channel scale [N, 1] (stored in `scale_dtype`, quantized with that one);
    as llm-compressor's min-max observer, the largest magnitude maps to 127.5 steps."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.5).clamp_min(1e-12).to(scale_dtype)
    return torch.round(w / scale.float()).clamp_(-128, 127).to(torch.int8), scale


def rtn_int4(
    w: torch.Tensor, group: int, scale_dtype: torch.dtype, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[N, K] → signed 4-bit values int8 [N, K] in -8..7, per-group scales [N, K/G] and (asymmetric) signed zero
    points int8 [N, K/G], as compressed-tensors' min-max observer: symmetric maps the largest magnitude to 7.5
    steps; asymmetric spans [min, max] (0 included) in 15 steps, x ≈ (q - zero) · scale."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)
    if symmetric:
        scale = (torch.maximum(-lo, hi) / 7.5).clamp_min(1e-12).to(scale_dtype)
        q = torch.round(g / scale.float()[..., None]).clamp_(-8, 7).to(torch.int8)
        return q.view(n, k), scale, None
    scale = ((hi - lo) / 15).to(scale_dtype)
    scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale)
    zero = torch.round((-8 - lo / scale.float()).clamp(-8, 7))
    q = torch.round(g / scale.float()[..., None] + zero[..., None]).clamp_(-8, 7).to(torch.int8)
    return q.view(n, k), scale, zero.to(torch.int8)


def pack_int4_words(q: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit values [N, K] → compressed-tensors' int32 words [N, K/8] (value + 8, element i in bits 4i)."""
    nibbles = pack_nibbles((q.to(torch.int16) + 8).to(torch.uint8)).contiguous()
    if sys.byteorder == "little":
        return nibbles.view(torch.int32).clone()
    b = nibbles.view(q.shape[0], -1, 4).to(torch.int64)
    return (b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24).to(torch.int32)


def quantization_config(scheme: str, group_size: int, ignore: list[str], symmetric: bool = True) -> dict:
    """config.json's quantization_config as llm-compressor writes it for the W8A8 / W4A16(_ASYM) presets."""
    fmt = "int-quantized" if scheme == "w8a8" else "pack-quantized"
    weights = {
        "num_bits": 8 if scheme == "w8a8" else 4,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "channel" if scheme == "w8a8" else "group",
        "group_size": None if scheme == "w8a8" else group_size,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    acts = None
    if scheme == "w8a8":
        acts = {**weights, "num_bits": 8, "strategy": "token", "dynamic": True, "observer": None, "symmetric": True}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {**group, "format": fmt}},
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def _is_linear_weight(name: str, tensor: torch.Tensor, lm_head: bool) -> bool:
    module, _, leaf = name.rpartition(".")
    if leaf != "weight" or tensor.dim() != 2 or not tensor.is_floating_point():
        return False
    if module == "lm_head":
        return lm_head
    return ".layers." in f".{module}" and module.rpartition(".")[2] not in ROUTERS


def quantize(
    src: str | Path,
    dst: str | Path,
    scheme: str,
    group_size: int = 128,
    lm_head: bool = False,
    shard_bytes: int = SHARD_BYTES,
    symmetric: bool = True,
    smooth: float | None = None,
) -> QuantizeReport:
    """Write the quantized checkpoint of `src` into `dst` (created; must not exist or be empty), in safetensors
    files of at most `shard_bytes` each (beyond one, with an index, as transformers writes them). `smooth`
    (w8a8): SmoothQuant's strength α, calibrated on a text that ships with Python (engine.quant.smooth)."""
    if scheme not in SCHEMES:
        raise ModelLoadError(f"scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
    if scheme == "w8a8" and not symmetric:
        raise ModelLoadError("w8a8 weights are symmetric (vLLM's int8 kernels take no weight zero points)")
    if scheme == "w4a16" and (group_size < 8 or group_size % 8):
        raise ModelLoadError(f"group size must be a positive multiple of 8; got {group_size}")
    files, out = DirectoryFiles(src), Path(dst)
    hf = read_json(files, "config.json")
    if "quantization_config" in hf:
        raise ModelLoadError(f"{src} is already quantized ({hf['quantization_config'].get('quant_method')})")
    if out.exists() and any(out.iterdir()):
        raise ModelLoadError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    report = QuantizeReport(scheme, group_size if scheme == "w4a16" else None, kept=[] if lm_head else ["lm_head"])
    report.symmetric = symmetric
    factors: dict[str, torch.Tensor] = {}
    if smooth is not None:
        if scheme != "w8a8":
            raise ModelLoadError("smoothing moves activation outliers into the weights: it is for w8a8 only")
        from engine.quant.smooth import smoothing  # runs the float model: imports the engine

        factors = smoothing(files.path, hf, smooth)
        report.method, report.smooth_alpha = "smoothquant+rtn", smooth
    shard: dict[str, torch.Tensor] = {}
    written: list[tuple[Path, list[str]]] = []  # each full shard goes to disk at once: memory stays one shard

    def flush() -> None:
        part = out / f".part-{len(written)}.safetensors"
        save_file(shard, str(part), metadata={"format": "pt"})
        written.append((part, list(shard)))
        shard.clear()

    try:
        _convert_all(files, scheme, group_size, lm_head, shard_bytes, report, shard, flush, factors)
    except BaseException:
        for part, _ in written:  # a failed run leaves the destination as it found it
            part.unlink(missing_ok=True)
        raise
    qc = quantization_config(scheme, group_size, report.kept, symmetric)
    _write(files.path, out, hf, written, qc, report)
    return report


def _convert_all(
    files: DirectoryFiles,
    scheme: str,
    group_size: int,
    lm_head: bool,
    shard_bytes: int,
    report: QuantizeReport,
    shard: dict[str, torch.Tensor],
    flush: Callable[[], None],
    factors: dict[str, torch.Tensor],
) -> None:
    names, size = weight_files(files), 0
    with tqdm(total=len(names), desc=f"quantize {scheme}", unit="file", file=sys.stderr) as bar:
        for fname in names:
            with safe_open(files.path / fname, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118  # safe_open is not iterable
                    t = f.get_tensor(key)
                    report.bytes_in += t.nbytes
                    if key in factors:  # smoothing: norms shrink, the weights after them grow to match
                        t = (t.float() * factors[key]).to(t.dtype if key.endswith("norm.weight") else torch.float32)
                    for name, value in _convert(key, t, scheme, group_size, lm_head, report).items():
                        if size + value.nbytes > shard_bytes and shard:
                            flush()
                            size = 0
                        shard[name] = value.contiguous()
                        size += value.nbytes
                        report.bytes_out += value.nbytes
            bar.update(1)
    flush()


def _convert(
    name: str, t: torch.Tensor, scheme: str, group: int, lm_head: bool, report: QuantizeReport
) -> dict[str, torch.Tensor]:
    if not _is_linear_weight(name, t, lm_head):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and t.dim() == 2 and module.rpartition(".")[2] in ROUTERS:
            report.kept.append(module)
        return {name: t}
    module = name.removesuffix(".weight")
    report.quantized += 1
    scale_dtype = t.dtype if t.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    if scheme == "w8a8":
        q, scale = rtn_int8(t, scale_dtype)
        return {f"{module}.weight": q, f"{module}.weight_scale": scale}
    if t.shape[1] % group:
        raise ModelLoadError(f"{module}: in_features {t.shape[1]} is not a multiple of the group size {group}")
    q, scale, zero = rtn_int4(t, group, scale_dtype, report.symmetric)
    shape = torch.tensor(list(t.shape), dtype=torch.int64)
    out = {
        f"{module}.weight_packed": pack_int4_words(q),
        f"{module}.weight_scale": scale,
        f"{module}.weight_shape": shape,
    }
    if zero is not None:  # packed along the output dimension, as compressed-tensors does
        out[f"{module}.weight_zero_point"] = pack_int4_words(zero.T.contiguous()).T.contiguous()
    return out


def _write(
    src: Path, out: Path, hf: dict, parts: list[tuple[Path, list[str]]], qc: dict, report: QuantizeReport
) -> None:
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (INDEX, "config.json"):
            shutil.copy2(p, out / p.name)
    if len(parts) == 1:
        parts[0][0].rename(out / "model.safetensors")
    else:
        weight_map = {}
        for i, (part, names) in enumerate(parts):
            fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            part.rename(out / fname)
            weight_map |= dict.fromkeys(names, fname)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": report.bytes_out}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps({**hf, "quantization_config": qc}, indent=2))
    (out / "tianmen-quant.json").write_text(json.dumps(asdict(report), indent=2))
