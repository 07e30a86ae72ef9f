"""The engine's CPU GEMM kernels against the GEMMs they replace, on Qwen2-0.5B's linear shapes.

    python -m benchmarks.gemm [--kernel bf16mm|wbf16] [--rows 1,4,32,64,4096] [--repeat 10]

--kernel bf16mm (the default where the CPU has AVX512-BF16): engine.kernels.bf16mm, bf16 in and out, against
oneDNN's prepacked bf16 GEMM (what the engine runs without it) and F.linear in bf16 (what transformers runs);
the gate_up row also times the fused silu(gate) * up epilogue against the plain GEMM followed by torch's SiLU
and multiply.
--kernel wbf16 (the default elsewhere): engine.kernels.wbf16, bf16 weights under float32 math (from BLAS_ROWS
rows on it widens the weight and calls torch's GEMM), against oneDNN's prepacked fp32 GEMM and F.linear fp32.

Each row: milliseconds per call, best of --repeat, results checked against F.linear first. Weights are hot in
cache after warm-up, so batch 1 here understates the kernels' gain in a model, where they stream from memory.
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.timing import best_seconds
from engine.kernels import bf16mm, wbf16
from engine.kernels.gemm import GemmKernel
from engine.malloc import keep_freed_memory

SHAPES = {"qkv": (1152, 896), "gate_up": (9728, 896), "down": (896, 4864), "lm_head": (151936, 896)}


def per_call_ms(f: Callable[[], object], repeat: int) -> float:
    return best_seconds(f, repeat) * 1e3


def _gemm_then_silu_mul(x: torch.Tensor, onednn: torch.Tensor) -> torch.Tensor:
    gate, up = torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "").chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=["bf16mm", "wbf16"], default="bf16mm" if bf16mm.supported() else "wbf16")
    ap.add_argument("--rows", default="1,4,32,64,4096")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    keep_freed_memory()  # as the engine does on CPU: fresh outputs reuse memory instead of page-faulting
    kernel: GemmKernel | None = bf16mm.kernel() if args.kernel == "bf16mm" else wbf16.kernel()
    if kernel is None:
        raise SystemExit(f"{args.kernel} is not available here (no AVX512-BF16, or see the warning above)")
    dtype = torch.bfloat16 if args.kernel == "bf16mm" else torch.float32
    name = "oneDNN bf16" if dtype == torch.bfloat16 else "oneDNN fp32"
    print(f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; ms per call (best)")
    print(f"{'weight':>12} {'N x K':>13} {'M':>5} {args.kernel:>10} {name:>12} {'F.linear':>9} {'gain':>6}")
    for wname, (n, k) in SHAPES.items():
        w = torch.randn(n, k).bfloat16().to(dtype)
        packed, onednn = kernel.pack(w), torch.ops.mkldnn._reorder_linear_weight(w, 32)
        for m in (int(r) for r in args.rows.split(",")):
            if wname == "lm_head" and m > 64:
                continue  # the LM head only ever sees the sampled rows, one per sequence
            x = torch.randn(m, k).to(dtype)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
            torch.testing.assert_close(kernel.linear(x, packed, n, None), F.linear(x, w), rtol=tol, atol=tol)
            ours = per_call_ms(partial(kernel.linear, x, packed, n, None), args.repeat)
            dnn = per_call_ms(partial(torch.ops.mkldnn._linear_pointwise, x, onednn, None, "none", [], ""), args.repeat)
            mkl = per_call_ms(partial(F.linear, x, w), args.repeat)
            print(f"{wname:>12} {f'{n} x {k}':>13} {m:>5} {ours:>10.2f} {dnn:>12.2f} {mkl:>9.2f} {dnn / ours:>5.2f}x")
            if wname == "gate_up" and isinstance(kernel, bf16mm.BF16MM):
                fused = bf16mm.SiluMulBF16MM(kernel)
                fpacked = fused.pack(w)

                ours = per_call_ms(partial(fused.linear, x, fpacked, n, None), args.repeat)
                dnn = per_call_ms(partial(_gemm_then_silu_mul, x, onednn), args.repeat)
                label = "+silu*up"
                print(f"{label:>12} {f'{n} x {k}':>13} {m:>5} {ours:>10.2f} {dnn:>12.2f} {'':>9} {dnn / ours:>5.2f}x")


if __name__ == "__main__":
    main()
