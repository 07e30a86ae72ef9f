"""The bf16-weight float32 kernel against the fp32 GEMMs it replaces, on Qwen2-0.5B's linear shapes.

    python -m benchmarks.gemm [--rows 1,4,32,64,4096] [--repeat 10]

Each row: milliseconds per call for engine.kernels.wbf16 (bf16 weights, fp32 math; from BLAS_ROWS rows on it
widens the weight and calls torch's GEMM), oneDNN's prepacked fp32 GEMM (what the engine runs without the
kernel) and plain F.linear (MKL fp32, what transformers runs). Weights are hot in cache after warm-up, so
batch 1 here understates the kernel's gain in a model, where they stream from memory.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from engine.kernels import wbf16

SHAPES = {"qkv": (1152, 896), "gate_up": (9728, 896), "down": (896, 4864), "lm_head": (151936, 896)}


def per_call_ms(f: Callable[[], object], repeat: int) -> float:
    f()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,32,64,4096")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    kernel = wbf16.kernel()
    if kernel is None:
        raise SystemExit("the kernel could not be built here (see the warning above)")
    print(f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; ms per call (best)")
    print(f"{'weight':>8} {'N x K':>13} {'M':>5} {'bf16 kernel':>12} {'oneDNN fp32':>12} {'F.linear':>9} {'gain':>6}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k).bfloat16().float()
        packed, onednn = kernel.pack(w), torch.ops.mkldnn._reorder_linear_weight(w, 32)
        for m in (int(r) for r in args.rows.split(",")):
            if name == "lm_head" and m > 64:
                continue  # the LM head only ever sees the sampled rows, one per sequence
            x = torch.randn(m, k)
            torch.testing.assert_close(kernel.linear(x, packed, n, None), F.linear(x, w), rtol=1e-4, atol=1e-3)
            ours = per_call_ms(partial(kernel.linear, x, packed, n, None), args.repeat)
            dnn = per_call_ms(partial(torch.ops.mkldnn._linear_pointwise, x, onednn, None, "none", [], ""), args.repeat)
            mkl = per_call_ms(partial(F.linear, x, w), args.repeat)
            print(f"{name:>8} {f'{n} x {k}':>13} {m:>5} {ours:>12.2f} {dnn:>12.2f} {mkl:>9.2f} {dnn / ours:>5.2f}x")


if __name__ == "__main__":
    main()
