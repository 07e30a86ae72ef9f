"""Every quantized GEMM path of this CPU against the bf16 GEMM, streaming a decode step's weights from memory.

    python -m benchmarks.quant_gemm [--scheme w8a8|w4a16] [--group-size 128] [--rows 1,8,32,256] [--layers 24]

All the linear layers of --layers Qwen2-0.5B layers (QKV, O, gate/up, down: random weights, quantized round-to-
nearest), each path running every layer once per step as the model does, so a layer's weights come from memory
rather than cache (24 layers: ~720 MB in bf16, ~360 in int8, ~200 in int4). Prints milliseconds per step, best of
--repeat, for each path (engine.quant.paths.quant_paths: the ones that work on this CPU, the reference left
out) and for the dense GEMMs the engine would otherwise choose among (oneDNN; bf16mm and amxmm where the CPU
runs them), with the bytes each streams. The engine chooses among the same paths by timing them per shape (see README).
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable

import torch

from benchmarks.timing import best_seconds
from engine.kernels import amxmm, bf16mm
from engine.kernels.gemm import GemmPath, KernelPath, OneDNNPath
from engine.quant.grid import rtn_int4, rtn_int8
from engine.quant.paths import quant_paths
from engine.quant.weights import Int4Weight, Int8Weight, QuantWeight, pack_nibbles

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}


def quantize(w: torch.Tensor, scheme: str, group: int) -> QuantWeight:
    if scheme == "w8a8":
        q, scale = rtn_int8(w, torch.float32)
        return Int8Weight(q, scale.flatten().float())
    # bf16 scales, as a bf16 checkpoint quantized by `tianmen quantize` has them (the kernels' compact layout);
    # signed -8..7, stored as q + 8 with zero 8
    q, scale, _ = rtn_int4(w, group, torch.bfloat16, symmetric=True)
    return Int4Weight(pack_nibbles(q + 8), scale.float(), torch.full_like(scale, 8, dtype=torch.uint8), group)


def step(runs: list[Callable[[torch.Tensor], torch.Tensor]], xs: list[torch.Tensor]) -> Callable[[], None]:
    def go() -> None:
        for run, x in zip(runs, xs, strict=True):
            run(x)

    return go


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scheme", choices=["w8a8", "w4a16"], default="w4a16")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    dtype = torch.bfloat16 if bf16mm.supported() else torch.float32
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=g).mul_(0.02) for _ in range(args.layers) for n, k in SHAPES.values()]
    quant = [quantize(w, args.scheme, args.group_size) for w in dense]
    dense_bf16 = [w.to(dtype) for w in dense]
    del dense
    paths: dict[str, tuple[GemmPath, list]] = {}
    for p in quant_paths(dtype):
        if p.name != "torch-dequant" and all(p.accepts(w, None) for w in quant):
            paths[p.name] = (p, quant)
    # the dense GEMMs the engine would otherwise choose among: oneDNN, and our kernels where the CPU runs them
    dense_paths: list[GemmPath] = [OneDNNPath(dtype, 32)]
    if dtype == torch.bfloat16:
        dense_paths += [KernelPath(n, k, dtype) for n, k in (("bf16mm", bf16mm.kernel()), ("amxmm", amxmm.kernel()))
                        if k is not None]  # fmt: skip
    for base in dense_paths:
        paths[f"{base.name} ({str(dtype).removeprefix('torch.')})"] = (base, dense_bf16)
    nbytes = {name: sum(_bytes(w) for w in ws) for name, (_, ws) in paths.items()}
    prepared = {name: [p.prepare(w, None, None) for w in ws] for name, (p, ws) in paths.items()}

    print(f"\n{args.scheme}{f' group {args.group_size}' if args.scheme == 'w4a16' else ''}, {args.layers} layers of "
          f"Qwen2-0.5B's linear shapes, {dtype}; {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{'path':<28} {'MB':>6} " + " ".join(f"{f'{r} rows ms':>12}" for r in rows))
    for name, runs in prepared.items():
        cells = []
        for r in rows:
            xs = [torch.randn(r, w.shape[1], generator=g).to(dtype) for w in paths[name][1]]
            cells.append(best_seconds(step(runs, xs), args.repeat) * 1e3)
        print(f"{name:<28} {nbytes[name] / 1e6:>6.0f} " + " ".join(f"{c:>12.2f}" for c in cells))


def _bytes(w: torch.Tensor | QuantWeight) -> int:
    return w.nbytes() if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()


if __name__ == "__main__":
    main()
