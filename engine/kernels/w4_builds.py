"""The two layouts of a W4A16 kernel's scales, and the builds that read them (engine/kernels/w4mm_common.h and
w4f32.c, -DSCALE16).

A packed int4 copy holds, per group of inputs and packed block of columns, each column's scale s and the term of
its zero point: by default both as floats (8 bytes a column), or, where the checkpoint's scales are bf16 values
(what a bf16 model quantized by `tianmen quantize` or llm-compressor stores), s as bf16 and the zero point as a
byte (3 bytes a column), the float term made in the kernel, exactly: the same bits from 37.5% of the bytes. Each
kernel is built for both layouts; a path or grouped call takes the build that matches a weight's scales
(PackedLayoutKernel.for_scales), and a build refuses the other layout's copy.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch

from engine.kernels.cbuild import Once

log = logging.getLogger(__name__)


class Packed(Protocol):
    compact: bool


def compact_scales(scale: torch.Tensor) -> bool:
    """Whether `scale` holds bf16 values only (what a bf16 checkpoint stores): the compact layout carries them
    exactly. Asked for the same tensor by every path and grouped call that considers a weight (~20 a weight), so
    the answer is kept while the tensor lives (a loaded weight's scales are never written in place)."""
    hit = _COMPACT.get(id(scale))
    if hit is not None and hit[0]() is scale:
        return hit[1]
    answer = bool(torch.equal(scale.float().to(torch.bfloat16).float(), scale.float()))
    _COMPACT[id(scale)] = (weakref.ref(scale), answer)
    weakref.finalize(scale, _COMPACT.pop, id(scale), None)
    return answer


# id(scale) → (a weak reference to it, compact_scales' answer); an entry leaves with its tensor
_COMPACT: dict[int, tuple[weakref.ref[torch.Tensor], bool]] = {}


class PackedLayoutKernel:
    """What a W4A16 kernel (w4mm's, w4vnni's, w4amx's, w4fp16's, w4f32's) knows of its build: whether it reads the
    compact scales (built with -DSCALE16), and its compact twin (the same build with -DSCALE16, set by Builds)."""

    compact = False
    twin: Callable[[], PackedLayoutKernel | None] | None = None

    def for_scales(self, scale: torch.Tensor) -> PackedLayoutKernel:
        """This build, or its compact twin where `scale` holds bf16 values and the twin builds and checks here: the
        same bits from fewer bytes (the scales 37.5% of theirs)."""
        if self.compact or self.twin is None or not compact_scales(scale):
            return self
        return self.twin() or self

    def check_layout(self, w: Packed) -> None:
        """ValueError unless `w` was packed in the layout this build reads (the other's scales are another size:
        the kernel would read past them)."""
        if w.compact != self.compact:
            raise ValueError(f"{type(self).__name__}: packed with {'compact' if w.compact else 'float'} scales")


def is_compact(kernel: object) -> bool:
    """Whether `kernel` is a build for the compact scales (PackedLayoutKernel; any other kernel is not)."""
    return isinstance(kernel, PackedLayoutKernel) and kernel.compact


KT = TypeVar("KT", bound=PackedLayoutKernel)


class Builds(Generic[KT]):
    """A W4A16 kernel in its four builds, each built and self-checked on first use: with software prefetch
    (PF_BYTES) and without (PF_BYTES=0), each for the float scales and the compact ones (-DSCALE16). The engine
    times a kernel's builds with and without prefetch against each other; the scales' layout is not timed but
    follows the weight (PackedLayoutKernel.for_scales)."""

    def __init__(
        self, make: Callable[[tuple[str, ...]], KT], consequence: str, check: Callable[[KT], None],
        supported: Callable[[], bool] = lambda: True, prefetch_variants: bool = True,
    ) -> None:  # fmt: skip
        """make(extra flags) → the kernel; consequence: what a failed default build means (logged once); supported:
        whether the CPU's flags allow the kernel at all (else no build is tried); prefetch_variants: False where
        the kernel is only ever used with its prefetch (no builds without it are made)."""
        self._supported = supported
        self._once: dict[tuple[bool, bool], Once[KT]] = {}
        for prefetch in (True, False) if prefetch_variants else (True,):
            for compact in (False, True):
                extra = (() if prefetch else ("-DPF_BYTES=0",)) + (("-DSCALE16",) if compact else ())
                what = consequence if prefetch and not compact else (
                    "W4A16 weights with bf16 scales keep the float scales' layout (more bytes)" if compact
                    else "this W4A16 kernel is not timed without software prefetch"
                )  # fmt: skip
                self._once[prefetch, compact] = Once(
                    functools.partial(self._make, make, extra, prefetch, compact), log, what, check=check
                )

    def _make(self, make: Callable[[tuple[str, ...]], KT], extra: tuple[str, ...], prefetch: bool, compact: bool) -> KT:
        kernel = make(extra)
        kernel.compact = compact
        if not compact:
            kernel.twin = lambda: self.get(prefetch, True)
        return kernel

    def get(self, prefetch: bool = True, compact: bool = False) -> KT | None:
        once = self._once.get((prefetch, compact))
        return once() if once is not None and self._supported() else None

    def kernel(self, compact: bool = False) -> KT | None:
        """The process-wide kernel (`compact`: its build for the compact scales); None where the CPU lacks what it
        needs, or (logged once) where it can't be built or fails its self-check."""
        return self.get(True, compact)

    def kernel_without_prefetch(self, compact: bool = False) -> KT | None:
        """The kernel built with no software prefetch (PF_BYTES=0), as kernel() otherwise: its prefetch distance
        was set on one CPU, so the engine times both."""
        return self.get(False, compact)
