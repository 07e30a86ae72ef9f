"""The one pass that hands a model its CPU kernels.

Layers own their reference math (torch) and take a kernel in one way: a module with `bind_kernels(kernels)`
picks what it can use from the `CpuKernels` it is given (RMSNorm, RoPE, decode attention, the sampler's argmax
and inverse CDF); linear layers get a GemmPlan, chosen per weight shape by timing (engine.kernels.select). The
runner calls `bind_cpu_kernels` once after loading and keeps only KV sizing and input preparation.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn

from engine.kernels import amxmm, bf16mm, cbuild, wbf16
from engine.kernels.gemm import Act, FusedSiluPath, GemmPath, KernelPath, OneDNNPath, TorchPath
from engine.kernels.kernel_set import CpuKernels
from engine.kernels.select import (
    CLASSES,
    CacheFlush,
    GemmPlan,
    GemmSelector,
    PlanCache,
    ShapeChoice,
    Timer,
    cache_key,
    call_seconds,
    streams_from_memory,
)
from engine.layers.linear import Linear
from engine.layers.mlp import GatedMLP
from engine.quant.paths import quant_paths
from engine.quant.transform import rotate_blocks
from engine.quant.weights import Int4Weight, QuantWeight

log = logging.getLogger(__name__)

# What the cached timings depend on: every kernel source (a kernel added or changed must be timed again) and the
# Python that chooses and runs them.
_HERE = Path(__file__).parent
_SOURCES = sorted(
    [*_HERE.glob("*.c"), *_HERE.glob("*.h")]
    + [
        _HERE / n
        for n in ("gemm.py", "select.py", "op_choice.py", "w4mm.py", "w4amx.py", "w4f32.py", "w4fp16.py", "w4vnni.py")
    ]
    + [_HERE / n for n in ("i8mm.py", "i8amx.py", "i8avx2.py")]
    + [_HERE.parent / "quant" / n for n in ("paths.py", "weights.py")]
)


@dataclass(slots=True)
class BindReport:
    """What was bound: per GEMM shape its choice and how many layers share it; for the start-up log."""

    shapes: dict[str, tuple[int, ShapeChoice]] = field(default_factory=dict)

    def lines(self) -> list[str]:
        return [f"gemm {shape} x{count}: {choice.describe()}" for shape, (count, choice) in self.shapes.items()]


TIMED_ONLY = "-noprefetch"  # a kernel variant the selection times, never one gemm_path can force


def gemm_paths(dtype: torch.dtype, batch_hint: int, use_kernels: bool, bf16_weights: bool) -> list[GemmPath]:
    """The candidates on this machine for `dtype` math; our kernels only where they built and passed their check."""
    onednn = OneDNNPath(dtype, batch_hint)
    paths: list[GemmPath] = [onednn, TorchPath(dtype)] if onednn.available else [TorchPath(dtype)]
    if not use_kernels:
        return paths
    if dtype == torch.bfloat16 and (k := bf16mm.kernel()) is not None:
        paths += [KernelPath("bf16mm", k, dtype), FusedSiluPath(bf16mm.SiluMulBF16MM(k))]
        if (plain := bf16mm.kernel_without_prefetch()) is not None:  # whether prefetching pays is measured
            # the builds pack alike: each pair shares one packed copy (layout), so a weight can hold both
            plain_silu = FusedSiluPath(bf16mm.SiluMulBF16MM(plain), "bf16mm-silu" + TIMED_ONLY, "bf16mm-silu")
            paths += [KernelPath("bf16mm" + TIMED_ONLY, plain, dtype, "bf16mm"), plain_silu]
        if (fma := bf16mm.kernel_fma32()) is not None:  # float32 FMAs over the same packed copies
            fma_silu = FusedSiluPath(bf16mm.SiluMulBF16MM(fma), "bf16fma-silu", "bf16mm-silu")
            paths += [KernelPath("bf16fma", fma, dtype, "bf16mm"), fma_silu]
    if dtype == torch.bfloat16 and (a := amxmm.kernel()) is not None:
        paths += [KernelPath("amxmm", a, dtype), FusedSiluPath(amxmm.SiluMulAMXMM(a), "amxmm-silu")]
        if (ap := amxmm.kernel_without_prefetch()) is not None:
            plain_silu = FusedSiluPath(amxmm.SiluMulAMXMM(ap), "amxmm-silu" + TIMED_ONLY, "amxmm-silu")
            paths += [KernelPath("amxmm" + TIMED_ONLY, ap, dtype, "amxmm"), plain_silu]
    if dtype == torch.float32 and bf16_weights and (w := wbf16.kernel()) is not None:
        paths.append(KernelPath("wbf16", w, dtype))
        if (silu := wbf16.silu_mul_kernel()) is not None:
            paths.append(FusedSiluPath(silu, "wbf16-silu"))
        if (plain := wbf16.kernel_without_prefetch()) is not None:  # whether prefetching pays is measured
            paths.append(KernelPath("wbf16" + TIMED_ONLY, plain, dtype, "wbf16"))
            if silu is not None:
                paths.append(FusedSiluPath(wbf16.SiluMulWBF16(plain), "wbf16-silu" + TIMED_ONLY, "wbf16-silu"))
    return paths


def make_selector(
    paths: list[GemmPath], dtype: torch.dtype, forced: str = "auto", timer: Timer = call_seconds,
    cache_dir: Path | None = None, max_layouts: int = 2, model_bytes: int | None = None,
    settle: Callable[[], object] | None = None,
) -> GemmSelector:  # fmt: skip
    """A selector over `paths` that caches its timings on disk; with `forced`, that path wherever it applies
    (oneDNN, then F.linear, elsewhere), untimed. `model_bytes` (the weights' size): a model that takes at most
    half the last-level cache (the rest is for its KV cache and activations) stays there between steps, so its
    small batches are timed hot, without evicting it first. `settle`: the engine's memory step (huge pages), done
    to the trial copies too; the timings are cached apart from those made without it."""
    if forced != "auto":
        paths = [p for p in paths if not p.name.endswith(TIMED_ONLY)]  # only the timing chooses between those
        family = [p for p in paths if p.name.split("-")[0] == forced]  # bf16mm: its fused variant first
        if not family:
            log.warning("gemm_path=%s is not available on this CPU and dtype; using oneDNN / F.linear", forced)
        paths = sorted(paths, key=lambda p: (p not in family, p.name == forced, p.name != "onednn"))
        return GemmSelector(paths, dtype, None, timer, max_layouts, measure=False)
    cache = None
    try:
        directory = cache_dir or cbuild.cache_dir()
        cache = PlanCache(
            directory,
            cache_key(cbuild.cpu_signature(), _SOURCES)
            + "-"
            + str(dtype).removeprefix("torch.")
            + ("" if settle is not None else "-small-pages"),
        )
    except cbuild.BuildError as e:
        log.warning("GEMM timings will not be cached: %s", e)
    # NOTE: a flush writes 1.5x the last-level cache: 720 MB, ~50 ms, on a VM that reports 480 MB of L3, before
    # every timed small-batch call; for a model that fits in it, that was wasted (and made the test suite 2x longer)
    cold = model_bytes is None or streams_from_memory(model_bytes)
    return GemmSelector(paths, dtype, cache, timer, max_layouts, flush=CacheFlush() if cold else None, settle=settle)


def bind_cpu_kernels(
    model: nn.Module, extra: Iterable[object], kernels: CpuKernels, selector: GemmSelector, max_logit_rows: int
) -> BindReport:
    """Bind `kernels` into every module (and `extra` objects, e.g. the sampler) that takes them, and give every
    packable linear layer a GemmPlan. The LM head sees at most `max_logit_rows` rows a call."""
    for m in [*model.modules(), *extra]:
        bind = getattr(m, "bind_kernels", None)
        if bind is not None:
            bind(kernels)
    head = getattr(model, "lm_head", None)
    return plan_linears(model, selector, {id(head): max_logit_rows} if head is not None else {})


def plan_linears(model: nn.Module, selector: GemmSelector, max_rows: dict[int, int] | None = None) -> BindReport:
    """A GemmPlan for every packable linear layer, chosen per weight shape; `max_rows`: by module id. Layers a
    decode program calls (the model's `programmed_linears()`, after its kernels are bound) are timed as a program
    calls them at decode classes, and keyed apart ("... program") in the table."""
    rows_of = max_rows or {}
    listed = getattr(model, "programmed_linears", None)
    programmed = {id(m) for m in listed() if not _rotated(m)} if listed is not None else set()
    groups: dict[str, list[tuple[GatedMLP | Linear, Linear, Act | None]]] = defaultdict(list)
    gated = set()
    for m in model.modules():
        if isinstance(m, GatedMLP) and m.gate_up_proj.packable:
            gated.add(id(m.gate_up_proj))
            groups[_shape(m.gate_up_proj, m.act) + (" program" if id(m) in programmed else "")].append(
                (m, m.gate_up_proj, m.act)
            )
    for m in model.modules():
        if isinstance(m, Linear) and m.packable and id(m) not in gated:
            rows = rows_of.get(id(m))
            tail = (f" rows<={rows}" if rows else "") + (" program" if id(m) in programmed else "")
            groups[_shape(m, None) + tail].append((m, m, None))
    report = BindReport()
    quantized: GemmSelector | None = None
    for shape, units in groups.items():
        samples = [(_weight(lin), _bias(lin)) for _, lin, _ in units]
        chooser = selector
        if not isinstance(samples[0][0], torch.Tensor):  # quantized weights: their own candidates, same rules
            quantized = quantized or _quant_selector(selector)
            chooser = quantized
        prog = shape.endswith(" program")
        choice = chooser.choose(shape, samples, units[0][2], rows_of.get(id(units[0][0])), prog)  # type: ignore[arg-type]
        for owner, lin, act in units:
            w = _weight(lin)
            prepared = {name: chooser.paths[name].prepare(w, _bias(lin), act) for name in choice.layouts()}  # type: ignore[arg-type]
            block = getattr(lin, "input_block", None)  # a quantized layer's online rotation goes with its plan
            pre = partial(rotate_blocks, block=block) if block is not None else None
            owner.use_plan(GemmPlan([prepared[n] for n in choice.per_class], lin.in_features, choice.per_class, pre))
        report.shapes[shape] = (len(units), choice)
    return report


def _quant_selector(selector: GemmSelector) -> GemmSelector:
    """The quantized candidates under `selector`'s rules; a forced path's family (onednn, torch) leads."""
    paths = quant_paths(selector.dtype)
    if not selector.measure:
        lead = next(iter(selector.paths)).split("-")[0]
        paths.sort(key=lambda p: p.name.split("-")[0] != lead)
    return GemmSelector(
        paths,
        selector.dtype,
        selector.cache,
        selector.timer,
        selector.max_layouts,
        measure=selector.measure,
        flush=selector.flush,
        settle=selector.settle,
    )


def _rotated(m: nn.Module) -> bool:
    """Whether a layer (a gated MLP: its gate/up projection) rotates its inputs before its GEMM: a decode program
    then calls it whole from Python (llama_program._part), as the layers do."""
    lin = m.gate_up_proj if isinstance(m, GatedMLP) else m
    return getattr(lin, "input_block", None) is not None


def _bias(lin: Linear) -> torch.Tensor | None:
    return lin.bias.data if lin.bias is not None else None


def _weight(lin: Linear) -> torch.Tensor | QuantWeight:
    quantized = getattr(lin, "gemm_weight", None)  # engine.quant's layers: an Int8Weight / Int4Weight
    return quantized() if quantized is not None else lin.weight.data


def _shape(lin: Linear, act: Act | None) -> str:
    w = _weight(lin)
    kind = w.tag if not isinstance(w, torch.Tensor) else str(w.dtype).removeprefix("torch.")
    if isinstance(w, Int4Weight):
        kind += f"-g{w.group_size}"
    tags = [kind, "bias" if lin.bias is not None else "", "gated" if act else ""]
    silu = "silu" if act is not None and getattr(act, "is_silu_and_mul", False) else ""
    return f"{w.shape[0]}x{w.shape[1]} " + "+".join(t for t in (*tags, silu) if t)


__all__ = ["CLASSES", "BindReport", "CpuKernels", "bind_cpu_kernels", "gemm_paths", "make_selector"]
