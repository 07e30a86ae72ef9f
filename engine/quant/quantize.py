"""`tianmen quantize`: a bf16/fp32 HuggingFace directory → a compressed-tensors checkpoint (what llm-compressor
writes and vLLM loads): per-channel symmetric int8 (W8A8, activations quantized per token at run time) or
per-group 4-bit, symmetric or with zero points (W4A16), by round-to-nearest or by GPTQ (engine.quant.gptq),
optionally after SmoothQuant (W8A8) and after rotations (engine.quant.rotate: R1 and R2 fused into a float copy
first, then down_proj's inputs rotated online, engine.quant.transform). Embeddings, norms, MoE routers and
(unless asked) the LM head stay as they are. `tianmen-quant.json` records what was done."""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.errors import ModelLoadError
from engine.loader import INDEX, DirectoryFiles, copy_side_files, read_json, weight_files
from engine.quant.grid import rtn_int4, rtn_int8
from engine.quant.transform import InputRotation, rotate_blocks, transform_config
from engine.quant.weights import pack_nibbles

if TYPE_CHECKING:
    from engine.quant.gptq_model import GptqSettings, Quantized

SCHEMES = ("w8a8", "w4a16")
ROUTERS = ("gate", "router")  # a MoE layer's expert choice: small, and sensitive to rounding
SHARD_BYTES = 2 << 30
CT_VERSION = "0.20.1"  # the compressed-tensors release whose config this mirrors
DOWN_PROJ = "re:.*mlp\\.down_proj$"
# down_proj's online rotation: 64-wide blocks measured best of 64/128/512/whole on the demo model (97.1 / 96.8 /
# 96.2 / 96.2% top-1, W8A8 round-to-nearest after R1 + R2, an ad-hoc run with random-sign blocks); 64
# multiply-adds an input value, within the noise of Qwen2-0.5B's W8A8 throughput
ROTATE_BLOCK = 64


@dataclass(slots=True)
class QuantizeReport:
    """What `quantize` did (written as tianmen-quant.json)."""

    scheme: str
    group_size: int | None
    method: str = "rtn"
    symmetric: bool = True
    smooth_alpha: float | None = None
    gptq: dict[str, Any] | None = None  # how GPTQ calibrated (engine.quant.gptq_model.GptqSettings)
    rotation: dict[str, Any] | None = None  # engine.quant.rotate.Rotation, and down_proj's online block
    quantized: int = 0
    kept: list[str] = field(default_factory=list)
    # the head was tied to the embeddings and is now a quantized copy of its own (tie_word_embeddings false)
    untied_head: bool = False
    bytes_in: int = 0
    bytes_out: int = 0


def pack_int4_words(q: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit values [N, K] → compressed-tensors' int32 words [N, K/8] (value + 8, element i in bits 4i)."""
    nibbles = pack_nibbles((q.to(torch.int16) + 8).to(torch.uint8)).contiguous()
    if sys.byteorder == "little":
        return nibbles.view(torch.int32).clone()
    b = nibbles.view(q.shape[0], -1, 4).to(torch.int64)
    return (b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24).to(torch.int32)


def quantization_config(
    scheme: str, group_size: int, ignore: list[str], symmetric: bool = True, rotation: InputRotation | None = None
) -> dict:
    """config.json's quantization_config as llm-compressor writes it for the W8A8 / W4A16(_ASYM) presets (and,
    `rotation`, its SpinQuant R4 transform)."""
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
        "transform_config": transform_config(rotation) if rotation is not None else {},
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
    gptq: bool = False,
    gptq_settings: GptqSettings | None = None,
    rotate: bool = False,
) -> QuantizeReport:
    """Write the quantized checkpoint of `src` into `dst` (created; must not exist or be empty), in safetensors
    files of at most `shard_bytes` each (beyond one, with an index, as transformers writes them). `smooth`
    (w8a8): SmoothQuant's strength α; `gptq`: GPTQ instead of round-to-nearest (`gptq_settings`: how many
    calibration tokens, ...); both calibrate on a text that ships with Python (engine.quant.calibrate). `rotate`:
    quantize a rotated copy (engine.quant.rotate), with down_proj's inputs rotated online (Llama family)."""
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
    settings = None
    if gptq:
        from engine.quant.gptq_model import GptqSettings  # runs the float model: imports the engine

        settings = gptq_settings or GptqSettings()
    if not rotate:
        return _quantize(files, hf, out, scheme, group_size, lm_head, shard_bytes, symmetric, smooth, settings)
    from engine.quant.rotate import rotate_checkpoint

    turned_dir = out / ".rotated"  # beside the result, where the user made room: a float copy of the model
    try:
        turned = rotate_checkpoint(files.path, turned_dir)
        files = DirectoryFiles(turned_dir)
        # the largest power of two up to ROTATE_BLOCK that divides the MLP's width (1: no online rotation)
        block = math.gcd(ROTATE_BLOCK, int(hf.get("intermediate_size") or 1))
        down = InputRotation((DOWN_PROJ,), block) if block > 1 else None
        report = _quantize(
            files, read_json(files, "config.json"), out, scheme, group_size, lm_head, shard_bytes, symmetric,
            smooth, settings, down,
        )  # fmt: skip
    finally:
        shutil.rmtree(turned_dir, ignore_errors=True)
    online = {"targets": list(down.targets), "block": down.block} if down is not None else None
    report.rotation = {**asdict(turned), "online": online}
    report.bytes_in = sum((Path(src) / name).stat().st_size for name in weight_files(DirectoryFiles(src)))
    (out / "tianmen-quant.json").write_text(json.dumps(asdict(report), indent=2))
    return report


def _quantize(
    files: DirectoryFiles,
    hf: dict[str, Any],
    out: Path,
    scheme: str,
    group_size: int,
    lm_head: bool,
    shard_bytes: int,
    symmetric: bool,
    smooth: float | None,
    gptq: GptqSettings | None,
    rotation: InputRotation | None = None,
) -> QuantizeReport:
    report = QuantizeReport(scheme, group_size if scheme == "w4a16" else None, kept=[] if lm_head else ["lm_head"])
    report.symmetric = symmetric
    # NOTE: a tied head is the embedding matrix read a second time every step (Qwen2-0.5B: 272 of its 988 MB);
    # quantized, it becomes a module of its own while the embedding lookups keep the float matrix
    report.untied_head = lm_head and bool(hf.get("tie_word_embeddings"))
    factors: dict[str, torch.Tensor] = {}
    if smooth is not None:
        if scheme != "w8a8":
            raise ModelLoadError("smoothing moves activation outliers into the weights: it is for w8a8 only")
        from engine.quant.smooth import smoothing  # runs the float model: imports the engine

        factors = smoothing(files.path, hf, smooth)
        report.method, report.smooth_alpha = "smoothquant+rtn", smooth
    done: dict[str, Quantized] = {}
    if gptq is not None:
        from engine.quant.gptq import Grid
        from engine.quant.gptq_model import gptq_model

        def grid_for(dtype: torch.dtype) -> Grid:
            return Grid(group_size if scheme == "w4a16" else None, symmetric, _scale_dtype(dtype), gptq.clip)

        done = gptq_model(files.path, hf, grid_for, factors, gptq, lm_head, rotation)
        report.method = "smoothquant+gptq" if smooth is not None else "gptq"
        report.gptq = asdict(gptq)
    shard: dict[str, torch.Tensor] = {}
    written: list[tuple[Path, list[str]]] = []  # each full shard goes to disk at once: memory stays one shard

    def flush() -> None:
        part = out / f".part-{len(written)}.safetensors"
        save_file(shard, str(part), metadata={"format": "pt"})
        written.append((part, list(shard)))
        shard.clear()

    try:
        _convert_all(files, scheme, group_size, lm_head, shard_bytes, report, shard, flush, factors, done, rotation)
    except BaseException:
        for part, _ in written:  # a failed run leaves the destination as it found it
            part.unlink(missing_ok=True)
        raise
    qc = quantization_config(scheme, group_size, report.kept, symmetric, rotation)
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
    done: dict[str, Quantized],
    rotation: InputRotation | None = None,
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
                    module = key.removesuffix(".weight")
                    if rotation is not None and module not in done and rotation.applies_to(module):
                        t = rotate_blocks(t.double(), rotation.block).float()  # W·H: its inputs come in as x·H
                    out = _convert(key, t, scheme, group_size, lm_head, report, done)
                    if report.untied_head and key.endswith("embed_tokens.weight"):  # the head's own copy
                        out |= _convert("lm_head.weight", t, scheme, group_size, lm_head, report, done)
                    for name, value in out.items():
                        if size + value.nbytes > shard_bytes and shard:
                            flush()
                            size = 0
                        shard[name] = value.contiguous()
                        size += value.nbytes
                        report.bytes_out += value.nbytes
            bar.update(1)
    flush()


def _scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scales are stored in the weight's own float type (float32 for anything else)."""
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


def _convert(
    name: str,
    t: torch.Tensor,
    scheme: str,
    group: int,
    lm_head: bool,
    report: QuantizeReport,
    done: dict[str, Quantized] | None = None,
) -> dict[str, torch.Tensor]:
    """One checkpoint tensor → what the quantized checkpoint stores for it; `done`: values GPTQ chose, by module
    (the others round to nearest)."""
    done = done if done is not None else {}
    if not _is_linear_weight(name, t, lm_head):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and t.dim() == 2 and module.rpartition(".")[2] in ROUTERS:
            report.kept.append(module)
        return {name: t}
    module = name.removesuffix(".weight")
    report.quantized += 1
    if scheme == "w8a8":
        q, scale, _ = done.pop(module) if module in done else (*rtn_int8(t, _scale_dtype(t.dtype)), None)
        return {f"{module}.weight": q, f"{module}.weight_scale": scale}
    if t.shape[1] % group:
        raise ModelLoadError(f"{module}: in_features {t.shape[1]} is not a multiple of the group size {group}")
    if module in done:
        q, scale, zero = done.pop(module)
    else:
        q, scale, zero = rtn_int4(t, group, _scale_dtype(t.dtype), report.symmetric)
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
    copy_side_files(src, out)
    if len(parts) == 1:
        parts[0][0].rename(out / "model.safetensors")
    else:
        weight_map = {}
        for i, (part, names) in enumerate(parts):
            fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            part.rename(out / fname)
            weight_map |= dict.fromkeys(names, fname)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": report.bytes_out}, "weight_map": weight_map}))
    untied = {"tie_word_embeddings": False} if report.untied_head else {}
    (out / "config.json").write_text(json.dumps({**hf, **untied, "quantization_config": qc}, indent=2))
    (out / "tianmen-quant.json").write_text(json.dumps(asdict(report), indent=2))
