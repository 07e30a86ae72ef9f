"""What the tests of our int4 kernels (w4mm for bf16 math, w4f32 for float32) share: a random weight, and the
check that the measured selection keeps whichever of a kernel's two entry points times fastest."""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels.select import GemmSelector
from engine.quant.paths import quant_paths
from engine.quant.weights import Int4Weight, pack_nibbles


def int4_weight(n: int, k: int, g: int, symmetric: bool, seed: int = 0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), generator=gen)
    zero = torch.full((n, k // g), 8) if symmetric else torch.randint(0, 16, (n, k // g), generator=gen)
    scale = torch.rand(n, k // g, generator=gen) * 0.05 + 1e-3
    return Int4Weight(pack_nibbles(values), scale, zero.to(torch.uint8), g)


def packed_copies(run: Any, kind: type) -> set[int]:
    """The ids of the packed copies (instances of `kind`: any kernel's, int8 ones too) a prepared run's call closes
    over: paths over one layout must share one copy of a weight."""
    return {id(c.cell_contents) for c in run.call.__closure__ or () if isinstance(c.cell_contents, kind)}


class _Spy:
    """A kernel whose entry points say when they ran."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.calls = kernel, []

    def __getattr__(self, method: str) -> Any:
        def call(*args):  # type: ignore[no-untyped-def]
            self.calls.append(method)
            return getattr(self.kernel, method)(*args)

        return call


def assert_the_selection_keeps_the_fastest_entry(
    kernel: Any, path_class: type, dtype: torch.dtype, entries: tuple[str, ...] = ("direct", "panel")
) -> None:
    """Among the other quantized candidates for `dtype`, a timer that makes one entry point fast gets it chosen
    for every batch class."""
    spy = _Spy(kernel)
    ours = [path_class(spy, e) for e in entries]
    paths = [p for p in quant_paths(dtype) if not p.name.startswith(path_class.prefix)] + ours

    def fast(entry: str):  # type: ignore[no-untyped-def]
        def timer(fn) -> float:  # type: ignore[no-untyped-def]
            spy.calls.clear()
            fn()
            return 1e-6 if spy.calls == [entry.replace("-", "_")] else 1e-3

        return timer

    w = int4_weight(96, 256, 64, symmetric=False)
    for entry, path in zip(entries, ours, strict=True):
        choice = GemmSelector(paths, dtype, timer=fast(entry)).choose(entry, [(w, None)], None)  # type: ignore[list-item]
        assert choice.per_class == [path.name] * 5
