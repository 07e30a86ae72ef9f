"""Decode attention read in place from the paged KV cache, for CPU (engine/kernels/decode_attn.c).

Without it each layer gathers every sequence's K/V blocks into a contiguous copy and runs PyTorch's SDPA with
a padding mask. Measured on a 2-core Zen 4 (`python -m benchmarks.cpu_ops`), batch 32 x 176 tokens of context,
Qwen2-0.5B's heads: 0.37 ms a layer against 0.64 ms in bf16, 0.40 against 0.79 ms in float32."""

from __future__ import annotations

import bisect
import ctypes
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels.cbuild import Once, SelfCheckError, build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attn.c")
_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# Decode batch classes (1, <=8, <=32, more) at which reading the cache in place is timed against gather + SDPA
# (engine.kernels.op_choice): a kernel far ahead at one sequence can trail at 32 (measured on a Zen 3, 2026-12-02:
# 3.80 against 3.28 ms a layer), so the choice is made per class.
DECODE_ROWS = (1, 8, 32, 128)


def runs_at(at: tuple[bool, ...], rows: int) -> bool:
    """Whether a kernel chosen per class (`at`, one flag per DECODE_ROWS) runs a decode step of `rows` rows."""
    return bool(at) and at[bisect.bisect_left(DECODE_ROWS, rows, hi=len(DECODE_ROWS) - 1)]


class DecodeAttention:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._bind({torch.float32: lib.decode_attn_f32, torch.bfloat16: lib.decode_attn_bf16})

    def _bind(self, fns: dict[torch.dtype, Any]) -> None:
        """The C entry points by cache dtype; every kernel of this family takes the same arguments."""
        for f in fns.values():
            f.argtypes = [_i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _f32, _ptr, _int]
            f.restype = None
        self._fn = fns

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> DecodeAttention:
        return cls(build(SOURCE, flags))

    def entry(self, dtype: torch.dtype) -> Any | None:
        """The C entry point for caches of `dtype` (engine.kernels.program calls it directly), or None."""
        return self._fn.get(dtype)

    def takes(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        """The shapes the kernel is written for (decode_attn.c; any block size): others keep gather + SDPA."""
        return (
            dtype in self._fn
            and head_dim % 16 == 0
            and head_dim <= 256
            and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= 16
        )

    def takes_latent(self, num_heads: int, width: int, dtype: torch.dtype, block_size: int = 16) -> bool:
        """Whether MLA decode (engine.layers.mla) may run here: all query heads over one cached latent row of
        `width` that is K and V at once. Only kernels built for it say yes."""
        return False

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [B, H, D]; caches [blocks, block_size, KV, D]; block_tables [B, W] int64; context_lens [B] int64."""
        b, h, d = q.shape
        q = q.contiguous()
        tables, lens = block_tables.contiguous(), context_lens.contiguous()
        assert tables.dtype == lens.dtype == torch.int64 and k_cache.dtype == v_cache.dtype == q.dtype
        out = torch.empty_like(q)
        self._fn[q.dtype](
            b, h, k_cache.shape[2], d, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
            tables.data_ptr(), tables.shape[1], lens.data_ptr(), scale, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention in plain torch, one sequence at a time, in float32."""
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for i, n in enumerate(context_lens.tolist()):
        blocks = block_tables[i, : -(-n // bs)]
        k = k_cache[blocks].reshape(-1, kv, q.shape[-1])[:n].float().transpose(0, 1)  # [KV, n, D]
        v = v_cache[blocks].reshape(-1, kv, q.shape[-1])[:n].float().transpose(0, 1)
        qi = q[i].float().view(kv, -1, q.shape[-1])  # [KV, G, D]
        out[i] = F.scaled_dot_product_attention(qi, k, v, scale=scale).reshape(q.shape[1:])
    return out


def check_against_reference(
    kernel: DecodeAttention,
    dtypes: tuple[torch.dtype, ...],
    heads: tuple[tuple[int, int, int], ...],
    block_size: int,
    lens: tuple[int, ...],
) -> None:
    """`kernel` against `reference` over scattered blocks, with partial last blocks: one sequence per length."""
    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for h, kv, d in heads:
            width = max(-(-n // block_size) for n in lens)
            nblocks = len(lens) * width + 1
            kc, vc = (torch.randn(nblocks, block_size, kv, d, generator=g).to(dtype) for _ in range(2))
            kc[-1], vc[-1] = float("nan"), float("nan")  # stale cache memory: never read past a context's end
            q = torch.randn(len(lens), h, d, generator=g).to(dtype)
            tables = torch.randperm(nblocks - 1, generator=g)[: len(lens) * width].view(len(lens), width)
            used = torch.tensor(lens)
            for i, n in enumerate(lens):  # the unused tail of a table, and a partial block's rest, hold NaN
                tables[i, -(-n // block_size) :] = nblocks - 1
                kc[tables[i, (n - 1) // block_size], (n - 1) % block_size + 1 :] = float("nan")
                vc[tables[i, (n - 1) // block_size], (n - 1) % block_size + 1 :] = float("nan")
            got = kernel(q, kc, vc, tables, used, d**-0.5).float()
            want = reference(q, kc, vc, tables, used, d**-0.5)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            if not torch.allclose(got, want, rtol=tol, atol=tol):
                raise SelfCheckError(f"self-check failed for {dtype}, {h}/{kv} heads of {d}")


def self_check(kernel: DecodeAttention) -> None:
    """Both dtypes: G = 1 and 7, head_dim 16/64, blocks of 4 tokens."""
    check_against_reference(kernel, (torch.float32, torch.bfloat16), ((7, 1, 64), (4, 4, 16)), 4, (14, 1, 9))


def check_peaked_scores(kernel: DecodeAttention) -> None:
    """Scores far apart (one key aligned with the query, 300 others near zero, bf16): the running maximum must
    carry across the kernel's slices or segments, or exp() over- or underflows."""
    g = torch.Generator().manual_seed(3)
    d, n = 64, 300
    q = torch.randn(1, 4, d, generator=g).bfloat16() * 8
    kc = torch.randn(n // 16 + 1, 16, 1, d, generator=g).bfloat16() * 0.01
    kc.view(-1, d)[250] = q[0, 0] * 4  # the peak sits late: past the first 128-token segment, in a late slice
    vc = torch.randn_like(kc)
    tables = torch.arange(n // 16 + 1).view(1, -1)
    lens = torch.tensor([n])
    got = kernel(q, kc, vc, tables, lens, d**-0.5).float()
    want = reference(q, kc, vc, tables, lens, d**-0.5)
    if not (torch.isfinite(got).all() and torch.allclose(got, want, rtol=2e-2, atol=2e-2)):
        raise SelfCheckError("self-check failed for peaked scores")


def bf16_slices_fit(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int) -> bool:
    """What the bf16 kernels that read 16-token slices of a block 32 of head_dim at a time need
    (decode_attn_dp.c, decode_attn_amx.c): a slice never crosses a block, G = H / KV <= 16."""
    return (
        dtype == torch.bfloat16
        and block_size % 16 == 0
        and head_dim % 32 == 0
        and head_dim <= 256
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 16
    )


def self_check_bf16(kernel: DecodeAttention) -> None:
    """For kernels of 16-token blocks and bf16 only: G = 1, 7 and 16, head_dim 32/64/128, contexts across
    segments of 128 tokens, odd and even, under and over one block; peaked scores."""
    heads = ((7, 1, 64), (4, 4, 32), (16, 1, 128))
    check_against_reference(kernel, (torch.bfloat16,), heads, 16, (1, 16, 17, 300, 128, 129, 2))
    check_peaked_scores(kernel)


# The process-wide kernel built for this CPU, or None (logged once) where it cannot be built.
kernel = Once(DecodeAttention.build, log, "decode attention will gather K/V and run SDPA (slower)", check=self_check)

# The same kernel asking for the next chunk's rows spread through its score loop (PF_SPREAD in decode_attn.c):
# faster cold where it was measured, so engine.kernels.op_choice times it beside the plain build.
kernel_with_prefetch = Once(
    lambda: DecodeAttention.build(("-march=native", "-DPF_SPREAD=1")), log,
    "decode attention is not timed with the spread prefetch", check=self_check,
)  # fmt: skip
