"""Quantization swaps modules: each linear layer the checkpoint quantizes becomes a QuantLinear that holds the
checkpoint's tensors under their own names while loading, then the in-memory form (engine.quant.weights).
Embeddings, norms, MoE routers and whatever the checkpoint leaves out (by default the LM head) stay as they are."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.linear import Linear
from engine.layers.parallel import Part
from engine.quant.layouts import stored_tensors, to_weight
from engine.quant.spec import QuantSpec
from engine.quant.transform import rotate_blocks
from engine.quant.weights import QuantWeight


class QuantLinear(Linear):
    """A linear layer with a quantized weight; forward is the reference (dequantize, then matmul) until the
    engine gives it a GemmPlan. A layer whose plain weight is read elsewhere (packable False) is dequantized
    once at load instead."""

    bf16_storage = False
    scheme = ""

    def __init__(self, lin: Linear, spec: QuantSpec, input_block: int | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.spec = lin.in_features, lin.out_features, spec
        # compressed-tensors' online Hadamard (engine.quant.transform): the stored weight is W·H, x·H goes in
        self.input_block = input_block
        if input_block is not None and lin.in_features % input_block:
            raise ModelLoadError(f"{lin.in_features} inputs are not whole Hadamard blocks of {input_block}")
        self.packable = lin.packable
        self.shard_offsets: dict[str, tuple[int, int]] = dict(getattr(lin, "shard_offsets", {}))
        device = lin.weight.device
        self.stored = {t.name: t for t in stored_tensors(spec, lin.out_features, lin.in_features)}
        for t in self.stored.values():
            self.register_parameter(t.name, nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device=device), False))
        self.bias = lin.bias
        self.plan = None
        self.quantized: QuantWeight | None = None
        self.kept: QuantWeight | None = None  # packable False: the checkpoint's weight beside the dequantized one
        # tensor parallel: where this rank's rows (column-parallel) or columns (row-parallel) lie in each tensor
        self.checkpoint_starts: dict[str, int] = dict(getattr(lin, "checkpoint_starts", {}))
        self.split_dim: int | None = None
        source = getattr(lin, "tp_slices", None)
        if source is not None:
            self.split_dim = source["weight"].dim
            self.tp_slices = {"bias": source["bias"], **self._parts(source["weight"])}
        elif self.checkpoint_starts:
            self.split_dim = 0

    def _parts(self, weight: Part) -> dict[str, Part]:
        """The weight's part (rows: dim 0, columns: dim 1 of [N, K]) in each stored tensor's own layout; a tensor
        that does not run along the split dimension (a per-channel scale under a column split) is read whole."""
        parts = {}
        for name, t in self.stored.items():
            dim, per = (t.out_dim, t.per_index) if weight.dim == 0 else (t.in_dim, t.per_in)
            if dim is None:
                continue
            if weight.start % per or weight.length % per:
                raise ModelLoadError(f"a rank's {weight.length} of {name} do not split the packed or grouped axis")
            parts[name] = Part(dim, weight.start // per, weight.length // per)
        return parts

    def checkpoint_part(self, name: str, shard: str) -> Part | None:
        """The part of checkpoint tensor `name` (a leaf: weight_scale, bias, ...) of projection `shard` this rank
        loads (column-parallel merged layers); None: the whole tensor."""
        start = self.checkpoint_starts.get(shard)
        if start is None:
            return None
        size = self.shard_offsets[shard][1]
        t = self.stored.get(name)
        if t is None:  # the bias
            return Part(0, start, size)
        return self._parts(Part(0, start, size)).get(name)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        """One projection's tensor (q of qkv, gate of gate_up) into its rows (or packed columns) of `param`."""
        offset, size = self.shard_offsets[shard]
        if param is self.bias:
            assert loaded.shape[0] == size, f"shard {shard}: expected {size} rows, got {loaded.shape[0]}"
            param.data[offset : offset + size].copy_(loaded)
            return
        t = next(t for name, t in self.stored.items() if getattr(self, name) is param)
        if t.out_dim is None:  # weight_shape: the shard's own [N_shard, K] (its whole rows under tensor parallel)
            got = [int(v) for v in loaded.tolist()]
            assert got[1] == self.in_features and (got[0] == size or shard in self.checkpoint_starts), (
                f"shard {shard}: weight_shape {got}"
            )
            param.data.copy_(torch.tensor([self.out_features, self.in_features]))
            return
        assert offset % t.per_index == 0 and size % t.per_index == 0, f"shard {shard} splits a packed word"
        start, length = offset // t.per_index, size // t.per_index
        want = list(t.shape)
        want[t.out_dim] = length
        assert list(loaded.shape) == want, f"shard {shard} {t.name}: expected {want}, got {list(loaded.shape)}"
        param.data.narrow(t.out_dim, start, length).copy_(loaded)

    def finish_loading(self, dtype: torch.dtype) -> None:
        """Checkpoint tensors → the in-memory form; they are dropped. `dtype`: the model's, for a dequantized one."""
        tensors = {name: getattr(self, name).data for name in self.stored}
        shape = tensors.get("weight_shape")
        if shape is not None and self.split_dim is not None:  # the checkpoint's whole [N, K]: check the unsplit
            whole, local = [int(v) for v in shape.tolist()], [self.out_features, self.in_features]
            keep = 1 - self.split_dim
            if whole[keep] != local[keep]:
                raise ModelLoadError(f"weight_shape {whole} does not match this rank's layer {local}")
            tensors["weight_shape"] = torch.tensor(local)
        for name in self.stored:
            delattr(self, name)
        self.quantized = to_weight(self.spec, tensors, self.out_features, self.in_features)
        if not self.packable:
            self.weight = nn.Parameter(self.quantized.float().to(dtype), requires_grad=False)
            # NOTE: kept for whoever can use parts of it as they are (MLA's W_UV: engine.layers.mla)
            self.kept, self.quantized = self.quantized, None
        else:
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def gemm_weight(self) -> QuantWeight | torch.Tensor:
        return self.quantized if self.quantized is not None else self.weight.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan is not None:
            return self.plan(x)  # it rotates the inputs itself (engine.kernels.bind)
        if self.input_block is not None:
            x = rotate_blocks(x, self.input_block)
        if self.quantized is None:
            return super().forward(x)
        return self.quantized.reference(x, self.bias).to(x.dtype)

    def use_plan(self, plan: object) -> None:
        self.plan = plan  # type: ignore[assignment]
        self.quantized = None  # the plan holds what it needs


class W8A8Linear(QuantLinear):
    scheme = "w8a8"


class W4A16Linear(QuantLinear):
    scheme = "w4a16"


def replace_linear(module: nn.Module, make: Callable[[str, Linear], nn.Module | None], prefix: str = "") -> int:
    """Swap, recursively, every Linear child for `make(its name, it)` where that is not None; how many."""
    count = 0
    for name, child in list(module.named_children()):
        full = f"{prefix}{name}"
        if isinstance(child, Linear) and not isinstance(child, QuantLinear):
            new = make(full, child)
            if new is not None:
                setattr(module, name, new)
                count += 1
        else:
            count += replace_linear(child, make, full + ".")
    return count


def quantize_modules(model: nn.Module, spec: QuantSpec) -> int:
    """Swap the layers `spec` quantizes (by their checkpoint names) for QuantLinears; how many."""
    cls = W8A8Linear if spec.scheme == "w8a8" else W4A16Linear
    shard_names = {(ours, shard): ckpt for ckpt, (ours, shard) in getattr(model, "packed_modules_mapping", {}).items()}

    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)

    def make(name: str, lin: Linear) -> nn.Module | None:
        if tied and name == "lm_head":
            return None  # its weight is the embedding table
        parent, _, leaf = name.rpartition(".")
        shards = getattr(lin, "shard_offsets", None)
        names = [f"{parent}.{shard_names.get((leaf, s), leaf)}" for s in shards] if shards else [name]
        flags, blocks = {spec.quantizes(n) for n in names}, {spec.input_block(n) for n in names}
        if len(flags) > 1 or len(blocks) > 1:
            what = "quantizes" if len(flags) > 1 else "rotates the inputs of"
            raise ModelLoadError(f"the checkpoint {what} only some of {', '.join(names)}, which run as one layer")
        block = blocks.pop()
        if not flags.pop():
            if block is not None:
                raise ModelLoadError(f"{name}: an input rotation on a layer that is not quantized is not supported")
            return None
        try:
            return cls(lin, spec, block)
        except ModelLoadError as e:  # a tensor-parallel rank's share of a layer: say which layer
            raise ModelLoadError(f"{name}: {e}") from None

    if spec.fmt == "gptq":  # g_idx is k // group_size when desc_act is false: nothing to read
        model.ignored_weights = (*getattr(model, "ignored_weights", ()), ".g_idx")
    return replace_linear(model, make)


def finish_loading(model: nn.Module, dtype: torch.dtype) -> None:
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.finish_loading(dtype)
