"""Causal prefill attention of whole prompts on AMX tiles (engine/kernels/prefill_attn_amx.c), for bf16 on CPUs
with AMX-BF16.

A candidate, not a default: engine.kernels.op_choice times it against torch's SDPA at prompt lengths and the
attention layer takes it for the prompts it was measured faster at (engine.layers.attention).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels import amxmm
from engine.kernels.cbuild import BuildError, Once, SelfCheckError, build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("prefill_attn_amx.c")
MAX_HEAD_DIM = 256  # MAX_D in the C file

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class PrefillAttention:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.prefill_attn_amx_init.restype = ctypes.c_int
        if lib.prefill_attn_amx_init() != 0:
            raise BuildError("the kernel cannot use AMX: Linux refused the tile state (arch_prctl)")
        self._whole, self._paged = lib.prefill_attn_amx_bf16, lib.prefill_attn_amx_paged_bf16
        self._whole.argtypes = [_i64, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, ctypes.c_float, _ptr,
                                ctypes.c_int]  # fmt: skip
        self._paged.argtypes = [_i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, ctypes.c_float, _ptr,
                                ctypes.c_int]  # fmt: skip
        self._whole.restype = self._paged.restype = ctypes.c_int  # 0, or -1: a thread had no memory for scratch

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native", "-mamx-tile", "-mamx-bf16")) -> PrefillAttention:
        return cls(build(SOURCE, flags))

    @staticmethod
    def takes(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """What the tile layout needs: bf16, head_dim a multiple of 32 up to MAX_HEAD_DIM, whole head groups."""
        fits = dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= MAX_HEAD_DIM
        return fits and num_kv_heads > 0 and num_heads % num_kv_heads == 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, scale: float) -> torch.Tensor:
        """q [T, H, D], k and v [T, KV, D] (token rows may be strided, heads contiguous): `num_seqs` prompts of
        T / num_seqs tokens side by side, each attending causally to itself. Returns [T, H, D]."""
        t, h, d = q.shape
        q = rows_of(q)
        k, v = rows_of(k), rows_of(v)
        if k.stride(0) != v.stride(0):  # the kernel takes one row stride for both (views of one projection's rows)
            k, v = k.contiguous(), v.contiguous()
        out = torch.empty(t, h, d, dtype=q.dtype)
        rc = self._whole(
            num_seqs, t // num_seqs, h, k.shape[1], d, q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(),
            k.stride(0), scale, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return _written(out, rc)

    def paged(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
        context_len: int, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """One sequence's prompt chunk q [S, H, D] whose keys, its own among them, are the first `context_len` of
        the paged caches ([blocks, block_size, KV, D], block_size a multiple of 16) through `block_ids`: the query
        rows are positions context_len - S .. context_len - 1, each attending causally. Returns [S, H, D]."""
        s, h, d = q.shape
        q, ids = rows_of(q), block_ids.contiguous()
        assert ids.dtype == torch.int64 and k_cache.is_contiguous() and v_cache.is_contiguous()
        out = torch.empty(s, h, d, dtype=q.dtype)
        rc = self._paged(
            s, h, k_cache.shape[2], d, q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache.shape[1], ids.data_ptr(), context_len, scale, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return _written(out, rc)


def _written(out: torch.Tensor, rc: int) -> torch.Tensor:
    if rc != 0:  # some rows were never written: never hand them on
        raise MemoryError("prefill attention could not allocate its per-thread scratch")
    return out


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with each token's heads contiguous (token rows may be strided), copied where they are not."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, scale: float) -> torch.Tensor:
    """The same attention in float32 torch: the definition the kernel is checked against."""
    t, h, d = q.shape
    kv = k.shape[1]
    qs, ks, vs = (x.float().reshape(num_seqs, t // num_seqs, -1, d).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=h != kv)
    return out.transpose(1, 2).reshape(t, h, d)


def self_check(kernel: PrefillAttention) -> None:
    """Prompts under, at and over one 16-token block and one 32-key group, G = 1, 3, 7, head_dim 32-256, q/k/v
    as strided views of one projection's output (as the attention layer passes them)."""
    g = torch.Generator().manual_seed(0)
    for n, s, h, kv, d in ((1, 1, 4, 4, 32), (2, 17, 9, 3, 64), (3, 33, 14, 2, 64), (1, 70, 7, 1, 128),
                           (2, 40, 4, 2, 256)):  # fmt: skip
        qkv = torch.randn(n * s, (h + 2 * kv) * d, generator=g).bfloat16()
        q, k, v = qkv.split([h * d, kv * d, kv * d], -1)
        q, k, v = q.view(-1, h, d), k.view(-1, kv, d), v.view(-1, kv, d)
        got = kernel(q, k, v, n, d**-0.5).float()
        if not torch.allclose(got, reference(q, k, v, n, d**-0.5), rtol=2e-2, atol=2e-2):
            raise SelfCheckError(f"self-check failed for {n} prompts of {s} tokens, {h}/{kv} heads of {d}")


_once = Once(
    PrefillAttention.build, log, "prefill attention will run torch's SDPA (slower on short prompts)", check=self_check
)


def kernel() -> PrefillAttention | None:
    """The process-wide kernel for this CPU; None without AMX, or (logged once) where it can't be built."""
    return _once() if amxmm.supported() else None
