"""Model directory → torch module with weights. Files are read through a `ModelFiles` so a sealed
(encrypted) directory plugs in without the engine knowing how it is sealed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from torch import nn

from engine.errors import ConfigError, ModelLoadError
from engine.layers.parallel import Part
from engine.models.registry import model_class
from engine.parallel.group import Group, SingleGroup
from engine.quant.modules import finish_loading, quantize_modules
from engine.quant.spec import quant_spec

INDEX = "model.safetensors.index.json"


class ModelFiles(Protocol):
    """A model directory's files by name ("config.json", "model.safetensors", ...)."""

    def names(self) -> list[str]: ...
    def read(self, name: str) -> bytes: ...  # FileNotFoundError when absent
    def tensors(self, name: str) -> Iterator[tuple[str, torch.Tensor]]: ...


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet: a tensor-parallel rank reads only its part of it."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    def full(self) -> torch.Tensor: ...
    def part(self, dim: int, start: int, length: int) -> torch.Tensor: ...


class _InMemory:
    """A tensor already read whole (a sealed file decrypts into memory): parts are views of it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def full(self) -> torch.Tensor:
        return self.tensor

    def part(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, length)


class _SafetensorsSlice:
    """A tensor of an open safetensors file: `part` reads only the bytes of its rows (or columns)."""

    def __init__(self, handle: Any, key: str) -> None:
        self.handle, self.key = handle, key

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.handle.get_slice(self.key).get_shape())

    def full(self) -> torch.Tensor:
        return self.handle.get_tensor(self.key)

    def part(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.handle.get_slice(self.key)[index]


class DirectoryFiles:
    """A plain HuggingFace directory; safetensors are memory-mapped, not read whole."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelLoadError(f"model directory {str(self.path)!r} does not exist")

    def names(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if p.is_file())

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def tensors(self, name: str) -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(self.path / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  # safe_open is not iterable
                yield key, f.get_tensor(key)

    def lazy_tensors(self, name: str) -> Iterator[tuple[str, LazyTensor]]:
        """As tensors(), read on demand: valid while the iteration is at that tensor."""
        with safe_open(self.path / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  # safe_open is not iterable
                yield key, _SafetensorsSlice(f, key)


def lazy_tensors(files: ModelFiles, name: str) -> Iterator[tuple[str, LazyTensor]]:
    """A file's tensors read on demand where `files` can (DirectoryFiles), else read whole (sealed files: each
    tensor-parallel rank decrypts the whole file, then keeps its parts)."""
    lazy = getattr(files, "lazy_tensors", None)
    if lazy is not None:
        yield from lazy(name)
        return
    for key, tensor in files.tensors(name):
        yield key, _InMemory(tensor)


def tensors_from_bytes(data: bytes | bytearray | memoryview) -> Iterator[tuple[str, torch.Tensor]]:
    """For ModelFiles implementations that decrypt into memory."""
    yield from load_safetensors(bytes(data)).items()


def read_json(files: ModelFiles, name: str, required: bool = True) -> dict[str, Any]:
    try:
        data = files.read(name)
    except FileNotFoundError:
        if required:
            raise ModelLoadError(f"the model directory has no {name}") from None
        return {}
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{name} must hold a JSON object")
    return value


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy what a rewritten checkpoint keeps as it was (tokenizer, chat template, generation config): every
    file of `src` but the weights, their index and config.json, which the writer produces itself."""
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (INDEX, "config.json"):
            shutil.copy2(p, dst / p.name)


def eos_token_ids(files: ModelFiles, hf_config: dict[str, Any]) -> frozenset[int]:
    gen = read_json(files, "generation_config.json", required=False)
    eos = gen.get("eos_token_id", hf_config.get("eos_token_id"))
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


def weight_files(files: ModelFiles) -> list[str]:
    names = files.names()
    if INDEX in names:
        weight_map = read_json(files, INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{INDEX} has no weight_map")
        return sorted(set(weight_map.values()))
    found = [n for n in names if n.endswith(".safetensors")]
    if not found:
        raise ModelLoadError("the model directory has no *.safetensors weights")
    return found


def load_model(
    files: ModelFiles,
    hf_config: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    bf16_storage: bool = False,
    group: Group | None = None,
    expert_parallel: bool = False,
) -> nn.Module:
    """The model with its checkpoint loaded, in `dtype`; with a tensor-parallel `group`, this rank's part of it.

    bf16_storage (float32 math only): Linear and embedding weights start as bf16 and stay so where the
    checkpoint's tensor is bf16, for the bf16-weight kernel; others widen to float32 as they arrive. No float32
    copy of a bf16 checkpoint is ever made (measured: load peak 2.1 GiB instead of 3.1 for Qwen2-0.5B)."""
    model = build_model(hf_config, device, dtype, bf16_storage, group, expert_parallel)
    load_weights(model, files, widen_to=dtype)
    finish_loading(model, dtype)
    return model.eval()


def build_model(
    hf_config: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    bf16_storage: bool = False,
    group: Group | None = None,
    expert_parallel: bool = False,
) -> nn.Module:
    """The model's modules, weights not loaded; on the meta device it costs no memory (engine.memory sizes it)."""
    cls = model_class(hf_config)
    group = group or SingleGroup()
    spec = quant_spec(hf_config)  # checkpoint-format layers replace the linear layers it quantizes
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, group, expert_parallel)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json is missing or has a bad field: {e}") from None
    finally:
        torch.set_default_dtype(default_dtype)
    model.quantization = spec.scheme if spec is not None and quantize_modules(model, spec) else "none"
    if bf16_storage and dtype == torch.float32:
        _store_weights_as_bf16(model)
    return model


def _store_weights_as_bf16(model: nn.Module) -> None:
    swapped: dict[int, nn.Parameter] = {}  # old parameter → new, so tied weights stay one parameter
    for module in model.modules():
        if not (isinstance(module, nn.Embedding) or getattr(module, "bf16_storage", False)):
            continue
        old = module.weight
        if id(old) not in swapped:  # untouched allocations: no memory was committed for the float32 version
            swapped[id(old)] = nn.Parameter(torch.empty_like(old, dtype=torch.bfloat16), requires_grad=False)
        module.weight = swapped[id(old)]


def load_weights(model: nn.Module, files: ModelFiles, widen_to: torch.dtype | None = None) -> None:
    """Copy the checkpoint into the model. A bf16 parameter that receives a non-bf16 tensor is widened to
    `widen_to` first, so bf16 storage (load_model's bf16_storage) never rounds a float32 checkpoint."""
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    ignored: tuple[str, ...] = getattr(model, "ignored_weights", ())  # name suffixes
    ignored_prefixes: tuple[str, ...] = getattr(model, "ignored_prefixes", ())  # e.g. layers serving never runs
    elsewhere = getattr(model, "held_elsewhere", None)  # expert parallel: another rank's experts
    loaded: set[str] = set()
    for fname in weight_files(files):
        try:
            tensors = lazy_tensors(files, fname)
            for name, tensor in tensors:
                if name.endswith(ignored) or name.startswith(ignored_prefixes):
                    continue
                if elsewhere is not None and elsewhere(name):
                    loaded.add(name)
                    continue
                _load_one(model, params, mapping, name, tensor, fname, widen_to)
                loaded.add(name)
        except ModelLoadError:
            raise
        except FileNotFoundError:
            raise ModelLoadError(f"weight file {fname} is missing from the model directory") from None
        except Exception as e:  # safetensors' own errors, or a sealed file that fails its integrity check
            raise ModelLoadError(f"cannot read weight file {fname}: {e}") from None
    expected = _expected_checkpoint_names(model, params, mapping)
    missing = sorted(expected - loaded)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"the checkpoint lacks weights: {', '.join(missing[:5])}{more}")


def _load_one(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    mapping: dict[str, tuple[str, str]],
    name: str,
    lazy: LazyTensor,
    fname: str,
    widen_to: torch.dtype | None = None,
) -> None:
    for ckpt_name, (ours, shard) in mapping.items():
        if f".{ckpt_name}." in name:
            pname = name.replace(f".{ckpt_name}.", f".{ours}.")
            param = params.get(pname)
            if param is None:
                break
            module = model.get_submodule(pname.rsplit(".", 1)[0])
            part_of = getattr(module, "checkpoint_part", None)  # a quantized layer: each tensor has its layout
            if part_of is not None:
                part = part_of(pname.rsplit(".", 1)[1], shard)
            else:
                rows = getattr(module, "checkpoint_rows", lambda _: None)(shard)
                part = None if rows is None else Part(0, *rows)
            try:
                tensor = lazy.full() if part is None else lazy.part(part.dim, part.start, part.length)
                _widen_if_needed(param, tensor, widen_to)
                module.load_shard(param, tensor, shard)  # type: ignore[operator]
            except (AssertionError, RuntimeError, ValueError) as e:
                raise ModelLoadError(f"{fname}: weight {name} does not fit the model: {e}") from None
            return
    param = params.get(name)
    if param is None:
        if name == "lm_head.weight" and getattr(getattr(model, "args", None), "tie_word_embeddings", False):
            return  # a tied checkpoint that still stores the head
        raise ModelLoadError(f"{fname}: unexpected weight {name} (does config.json match the checkpoint?)")
    prefix, _, leaf = name.rpartition(".")
    part: Part | None = getattr(model.get_submodule(prefix), "tp_slices", {}).get(leaf)
    if part is None:
        tensor = lazy.full()
        if param.shape != tensor.shape:
            raise ModelLoadError(
                f"{fname}: weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        _widen_if_needed(param, tensor, widen_to)
        param.data.copy_(tensor)
        return
    _load_part(param, lazy, part, name, fname, widen_to)


def _load_part(
    param: nn.Parameter, lazy: LazyTensor, part: Part, name: str, fname: str, widen_to: torch.dtype | None
) -> None:
    """A tensor-parallel rank's part of a checkpoint tensor; the parameter's rows past it are zero padding."""
    if part.zero:
        param.data.zero_()
        return
    shape = lazy.shape
    fits = len(shape) == param.dim() and part.start + part.length <= shape[part.dim]
    if not fits or any(shape[d] != param.shape[d] for d in range(param.dim()) if d != part.dim):
        raise ModelLoadError(f"{fname}: weight {name} has shape {shape}, which does not fit this rank's part")
    tensor = lazy.part(part.dim, part.start, part.length)
    _widen_if_needed(param, tensor, widen_to)
    param.data.narrow(part.dim, 0, part.length).copy_(tensor)
    pad = param.shape[part.dim] - part.length
    if pad:
        param.data.narrow(part.dim, part.length, pad).zero_()


def _widen_if_needed(param: nn.Parameter, tensor: torch.Tensor, widen_to: torch.dtype | None) -> None:
    if widen_to is not None and param.dtype == torch.bfloat16 != tensor.dtype and widen_to != torch.bfloat16:
        param.data = param.data.to(widen_to)  # shards already loaded as bf16 widen exactly


def _expected_checkpoint_names(
    model: nn.Module, params: dict[str, nn.Parameter], mapping: dict[str, tuple[str, str]]
) -> set[str]:
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    names: set[str] = set()
    for pname in params:
        if tied and pname == "lm_head.weight":
            continue
        for ckpt_name, (ours, _) in mapping.items():
            if f".{ours}." in pname:
                names.add(pname.replace(f".{ours}.", f".{ckpt_name}."))
        if not any(f".{ours}." in pname for ours, _ in mapping.values()):
            names.add(pname)
    return names
