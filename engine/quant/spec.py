"""config.json's `quantization_config` → one QuantSpec: which scheme, which checkpoint format, which layers.

Accepted: compressed-tensors W8A8 (int-quantized: int8 per-channel symmetric weights, dynamic per-token int8
activations) and W4A16 (pack-quantized: 4-bit per-group weights, symmetric or with zero points); GPTQ and AWQ
(GEMM) 4-bit per-group weights with desc_act false. Anything else is refused by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import ModelLoadError
from engine.quant.transform import InputRotation, input_rotations, matches

SUPPORTED = (
    "compressed-tensors W8A8 (int-quantized, int8 per-channel symmetric weights, dynamic per-token activations), "
    "compressed-tensors W4A16 (pack-quantized, 4-bit per-group weights, symmetric or asymmetric), "
    "GPTQ and AWQ (GEMM) 4-bit per-group weights with desc_act false"
)
FORMATS = ("compressed-tensors", "gptq", "awq")


@dataclass(slots=True)
class QuantSpec:
    """What a quantized checkpoint holds. `targets` / `ignore`: layer names (checkpoint names) or `re:` patterns;
    the literal target "Linear" means every linear layer."""

    scheme: str  # w8a8 | w4a16
    fmt: str  # compressed-tensors | gptq | awq
    group_size: int = 0  # w4a16 only
    symmetric: bool = True
    targets: list[str] = field(default_factory=lambda: ["Linear"])
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    zero_offset: int = 0  # GPTQ v1 stores zero points minus one
    rotations: list[InputRotation] = field(default_factory=list)  # compressed-tensors' online transforms

    def input_block(self, name: str) -> int | None:
        """The Hadamard block size the inputs of layer `name` are rotated in at run time (None: not rotated)."""
        return next((r.block for r in self.rotations if r.applies_to(name)), None)

    def quantizes(self, name: str) -> bool:
        """Whether the checkpoint layer `name` (e.g. model.layers.0.self_attn.q_proj) is quantized."""
        if any(matches(p, name) for p in self.ignore):
            return False
        return any(p == "Linear" or matches(p, name) for p in self.targets)


def _refuse(what: str) -> ModelLoadError:
    return ModelLoadError(f"unsupported quantization: {what}; supported: {SUPPORTED}")


def quant_spec(hf_config: dict[str, Any]) -> QuantSpec | None:
    """None for an unquantized checkpoint; ModelLoadError naming the scheme for one we cannot run."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError("config.json's quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, hf_config.get("model_type"))
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    raise _refuse(f"quant_method {method!r}")


def _compressed_tensors(qc: dict[str, Any], model_type: str | None) -> QuantSpec:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("compressed-tensors without config_groups")
    if qc.get("sparsity_config"):
        raise _refuse("compressed-tensors with sparsity")
    if qc.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors with a quantized KV cache (kv_cache_scheme)")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _refuse(f"compressed-tensors with quantization_status {qc.get('quantization_status')!r}")
    specs, targets = [], []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _refuse(f"compressed-tensors config group {name!r} is not an object")
        specs.append(_ct_group(name, group, group.get("format") or qc.get("format")))
        targets += list(group.get("targets") or [])
    first = specs[0]
    if any((s.scheme, s.group_size, s.symmetric) != (first.scheme, first.group_size, first.symmetric) for s in specs):
        raise _refuse("compressed-tensors with several different schemes (mixed precision)")
    first.targets, first.ignore = targets, list(qc.get("ignore") or [])
    first.rotations = input_rotations(qc.get("transform_config"), model_type)
    return first


def _ct_group(name: str, group: dict[str, Any], fmt: str | None) -> QuantSpec:
    w, a = group.get("weights"), group.get("input_activations")
    if group.get("output_activations"):
        raise _refuse(f"compressed-tensors group {name!r} with quantized output activations")
    if not isinstance(w, dict) or w.get("type", "int") != "int":
        raise _refuse(f"compressed-tensors group {name!r} with weights {w!r}")
    bits, strategy, sym = w.get("num_bits"), w.get("strategy"), w.get("symmetric", True)
    if w.get("actorder") not in (None, False, "static"):
        raise _refuse(f"compressed-tensors group {name!r} with actorder {w.get('actorder')!r}")
    if bits == 8 and strategy == "channel" and sym and fmt == "int-quantized":
        ok_act = isinstance(a, dict) and a.get("num_bits") == 8 and a.get("type", "int") == "int"
        if not (ok_act and a.get("strategy") == "token" and a.get("dynamic") is True and a.get("symmetric", True)):
            raise _refuse(
                f"compressed-tensors int8 weights with input activations {a!r} (W8A8 needs dynamic per-token)"
            )
        return QuantSpec("w8a8", "compressed-tensors")
    if bits == 4 and strategy == "group" and fmt == "pack-quantized" and a is None:
        size = w.get("group_size")
        if not isinstance(size, int) or size < 2 or size % 2:
            raise _refuse(f"compressed-tensors 4-bit with group_size {size!r}")
        return QuantSpec("w4a16", "compressed-tensors", size, bool(sym))
    desc = f"{bits}-bit {strategy} {'symmetric' if sym else 'asymmetric'} weights"
    raise _refuse(f"compressed-tensors format {fmt!r} with {desc}, input activations {a!r}")


def _w4_group(method: str, bits: Any, size: Any) -> int:
    if bits != 4:
        raise _refuse(f"{method} with {bits}-bit weights")
    if not isinstance(size, int) or size < 2 or size % 2:
        raise _refuse(f"{method} with group_size {size!r} (per-group 4-bit needs a positive even group size)")
    return size


def _gptq(qc: dict[str, Any]) -> QuantSpec:
    size = _w4_group("gptq", qc.get("bits"), qc.get("group_size"))
    if qc.get("desc_act"):
        raise _refuse("gptq with desc_act true (act-order; re-quantize with desc_act false)")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {fmt!r}")
    ignore = ["lm_head", *(qc.get("modules_to_not_convert") or [])]
    return QuantSpec("w4a16", "gptq", size, bool(qc.get("sym", True)), ignore=ignore, zero_offset=int(fmt == "gptq"))


def _awq(qc: dict[str, Any]) -> QuantSpec:
    size = _w4_group("awq", qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size")))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"awq version {version!r} (only the GEMM layout)")
    ignore = ["lm_head", *(qc.get("modules_to_not_convert") or [])]
    return QuantSpec("w4a16", "awq", size, not qc.get("zero_point", True), ignore=ignore)
