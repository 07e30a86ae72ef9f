"""The engine's fused CPU kernels against the torch code they replace, at a batch-32 decode step of
Qwen2-0.5B's shape (and a 4,096-row prefill where it applies).

    python -m benchmarks.cpu_ops [--dtype bfloat16|float32] [--context 176] [--repeat 200]

Rows: paged decode attention (engine.kernels.decode_attn, read in place) against gathering the blocks and
running SDPA with a padding mask (the engine's path without it); with --dtype float32 also MLA's latent decode
(engine.kernels.decode_attn_latent: DeepSeek's 16 heads over 576-wide latent rows) at 32 and 1 sequences against
gathering the latents and SDPA (engine.layers.mla.latent_attention); residual add + RMSNorm, RoPE and greedy
argmax (engine.kernels.pointwise) against their eager torch definitions. Microseconds per call, best of
--repeat; outputs are checked against the torch code first.
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.timing import best_seconds
from engine.kernels import decode_attn, decode_attn_latent, pointwise
from engine.layers.mla import latent_attention
from engine.malloc import keep_freed_memory


def per_call_us(f: Callable[[], object], repeat: int) -> float:
    return best_seconds(f, repeat) * 1e6


def _paged(b: int, ctx: int, kv: int, d: int, dtype: torch.dtype, block: int = 16) -> tuple[torch.Tensor, ...]:
    width = -(-ctx // block)
    kc, vc = (torch.randn(b * width + 1, block, kv, d).to(dtype) for _ in range(2))
    tables = torch.randperm(b * width).view(b, width)  # scattered blocks, as in a long-running pool
    return kc, vc, tables, torch.full((b,), ctx, dtype=torch.int64)


def _latent_rows(ctx: int, repeat: int) -> list[tuple[str, float, float]]:
    """MLA decode over float32 latent rows (DeepSeek-V2/V3: 16 heads, 512 + 64 wide), in place against gathered."""
    kernel = decode_attn_latent.kernel()
    return [] if kernel is None else [_latent_row(kernel, b, ctx, repeat) for b in (32, 1)]


def _latent_row(kernel: decode_attn.DecodeAttention, b: int, ctx: int, repeat: int) -> tuple[str, float, float]:
    h, lat, width = 16, decode_attn_latent.VALUES, decode_attn_latent.WIDTH
    cache, _, tables, lens = _paged(b, ctx, 1, width, torch.float32)
    q = torch.randn(b, h, width)
    per_seq = tables.shape[1]
    hidden = (torch.arange(per_seq * 16) >= lens[:, None]).view(b, 1, 1, -1)
    mask = torch.zeros(b, 1, 1, per_seq * 16).masked_fill_(hidden, float("-inf"))
    scratch = torch.empty(0)

    def gathered() -> torch.Tensor:
        rows = torch.index_select(cache[:, :, 0], 0, tables.flatten(), out=scratch.resize_(b * per_seq, 16, width))
        return latent_attention(q, rows, mask, width**-0.5, lat)

    def in_place() -> torch.Tensor:
        return kernel(q, cache, cache, tables, lens, width**-0.5)[..., :lat]

    torch.testing.assert_close(in_place(), gathered(), rtol=1e-4, atol=1e-4)
    return f"MLA latent decode {b} x {ctx} fp32", per_call_us(in_place, repeat), per_call_us(gathered, repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--context", type=int, default=176, help="cached tokens per sequence (128 + 48 generated)")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    keep_freed_memory()  # as the engine does on CPU: fresh outputs reuse memory instead of page-faulting
    attn, pw = decode_attn.kernel(), pointwise.kernel()
    if attn is None or pw is None:
        raise SystemExit("the kernels could not be built here (see the warning above)")
    b, h, kv, d, hidden, vocab = 32, 14, 2, 64, 896, 151936
    rows: list[tuple[str, float, float]] = []

    kc, vc, tables, lens = _paged(b, args.context, kv, d, dtype)
    q = torch.randn(b, h, d).to(dtype)
    width = tables.shape[1]
    mask = torch.zeros(b, 1, 1, width * 16, dtype=dtype).masked_fill_(
        (torch.arange(width * 16) >= lens[:, None]).view(b, 1, 1, -1), float("-inf")
    )

    def gather_sdpa() -> torch.Tensor:
        k = kc[tables.flatten()].view(b, -1, kv, d).transpose(1, 2)
        v = vc[tables.flatten()].view(b, -1, kv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(q.view(b, kv, -1, d), k, v, attn_mask=mask, scale=d**-0.5)

    want = gather_sdpa().reshape(b, h, d).float()
    torch.testing.assert_close(attn(q, kc, vc, tables, lens, d**-0.5).float(), want, rtol=2e-2, atol=2e-2)
    rows.append(
        (
            f"decode attention {b} x {args.context}",
            per_call_us(lambda: attn(q, kc, vc, tables, lens, d**-0.5), args.repeat),
            per_call_us(gather_sdpa, args.repeat),
        )
    )

    if dtype == torch.float32:
        rows += _latent_rows(args.context, args.repeat)

    w = torch.randn(hidden).to(dtype)
    for n in (b, 4096):
        x, r = torch.randn(n, hidden).to(dtype), torch.randn(n, hidden).to(dtype)
        torch.testing.assert_close(pw.rms_norm(x, r, w, 1e-6)[0], pointwise.rms_norm(x, r, w, 1e-6)[0])
        rep = args.repeat if n < 1000 else 10
        rows.append(
            (
                f"add + RMSNorm {n} x {hidden}",
                per_call_us(lambda x=x, r=r: pw.rms_norm(x, r, w, 1e-6), rep),
                per_call_us(lambda x=x, r=r: pointwise.rms_norm(x, r, w, 1e-6), rep),
            )
        )
        qkv = torch.randn(n, (h + 2 * kv) * d).to(dtype)
        theta = torch.rand(n, 1, d) * 6.28  # unit rotations: repeated in-place calls keep the values in range
        cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
        qk = qkv[:, : (h + kv) * d].view(n, h + kv, d)
        rows.append(
            (
                f"RoPE {n} x {h + kv} x {d}",
                per_call_us(lambda qk=qk, cos=cos, sin=sin: pw.rotary(qk, cos, sin), rep),
                per_call_us(lambda qk=qk, cos=cos, sin=sin: pointwise.apply_rotary(qk, cos, sin), rep),
            )
        )

    logits = torch.randn(b, vocab)
    assert torch.equal(pw.argmax(logits), logits.argmax(dim=-1))
    rows.append(
        (
            f"argmax {b} x {vocab} fp32",
            per_call_us(lambda: pw.argmax(logits), args.repeat),
            per_call_us(lambda: logits.argmax(dim=-1), args.repeat),
        )
    )

    print(f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.dtype}")
    print(f"{'op':<34} {'kernel us':>10} {'torch us':>10} {'gain':>6}")
    for name, ours, theirs in rows:
        print(f"{name:<34} {ours:>10.1f} {theirs:>10.1f} {theirs / ours:>5.2f}x")


if __name__ == "__main__":
    main()
