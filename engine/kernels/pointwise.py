"""Small row-wise ops fused for CPU (engine/kernels/pointwise.c), beside the torch code each replaces:
residual add + RMSNorm (`rms_norm`), rotary embeddings (`apply_rotary`, and DeepSeek's on interleaved pairs,
`apply_rotary_interleaved`), a MoE layer's routing with its pairs grouped by expert (`route`; engine.layers.moe's
MoEGate and the argsort after it) and its combine of routed and shared rows (`moe_combine`) and greedy
sampling's torch.argmax (over float32 or bf16 logits: greedy rows read the LM head's output in its own dtype,
engine.sampler).

At decode's few rows the eager versions are a handful of torch ops whose dispatch dwarfs the arithmetic: add +
RMSNorm took 0.11 ms a call for 32 x 896 in the model on a 2-core Zen 4 (`python -m benchmarks.step_profile
--no-cpu-kernels`), 49 calls a step for a 24-layer model; at prefill's thousands of rows each op is a separate
pass over memory. torch.argmax over 32 x 151,936 float32 logits took 2.0 ms (`python -m benchmarks.cpu_ops`),
one thread scanning at a time. The kernels do each in one pass, with the same results.

A fused SiLU-and-mul was tried and dropped: torch's own (SLEEF-vectorised) SiLU plus the in-place multiply was
as fast at 32 and 4,096 rows."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.kernels.cbuild import Once, SelfCheckError, build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("pointwise.c")
_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_DTYPES = (torch.float32, torch.bfloat16)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate_half layout (HF Llama), in eager torch."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek), written de-interleaved as transformers'
    DeepSeek-V3 does. Its DeepSeek-V2 keeps the pairs interleaved: the same permutation of q and k, so q·k agrees."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def moe_combine(
    ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None, tokens: int
) -> torch.Tensor:
    """A MoE layer's output [tokens, H] from its routed rows ys [P, H] (expert after expert; row r is choice
    order[r] = t * K + k of token t, weighted by weights [tokens, K] float32) and its shared experts' rows
    (or None), in eager torch as transformers computes it: weighted rows rounded to the dtype, index_add_ in
    ys's order, then the shared rows added."""
    k = weights.shape[1]
    ys = (ys.float() * weights.flatten()[order].unsqueeze(1)).to(ys.dtype)
    out = ys.new_zeros(tokens, ys.shape[1]).index_add_(0, order // k, ys)
    return out + shared if shared is not None else out


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) in eager torch: the definition, as transformers computes it."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


class RouterSpec(Protocol):
    """What routing reads of a MoE router (engine.layers.moe.MoEGate)."""

    weight: torch.Tensor
    top_k: int
    scoring: str
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def route_config(gate: RouterSpec) -> torch.Tensor:
    """pointwise.c's route_t for `gate`: groups, groups kept, sigmoid scores, weights normalised (sigmoid only)."""
    sigmoid = gate.scoring == "sigmoid"
    return torch.tensor([gate.num_groups, gate.topk_groups, int(sigmoid), int(gate.norm_topk_prob and sigmoid)])


class PointwiseKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for f in (lib.rmsnorm_f32, lib.rmsnorm_bf16):
            f.argtypes = [_i64, _i64, _ptr, _ptr, _ptr, _f32, _ptr, _ptr, _int]
        for f in (lib.argmax_f32, lib.argmax_bf16):
            f.argtypes = [_i64, _i64, _ptr, _ptr, _int]
        lib.sample_f32.argtypes = [_i64, _i64, _ptr, _ptr, _ptr, _int]
        for f in (lib.rope_f32, lib.rope_bf16):
            f.argtypes = [_i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int]
        for f in (lib.rope_interleaved_f32, lib.rope_interleaved_bf16):
            f.argtypes = [_i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _int]
        for f in (lib.moe_route_f32, lib.moe_route_bf16):
            f.argtypes = [_i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _f32, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            f.restype = None
        for f in (lib.moe_combine_f32, lib.moe_combine_bf16):
            f.argtypes = [_i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _int]
            f.restype = _int
        entries = ("rmsnorm_f32", "rmsnorm_bf16", "argmax_f32", "argmax_bf16", "sample_f32", "rope_f32", "rope_bf16",
                   "rope_interleaved_f32", "rope_interleaved_bf16")  # fmt: skip
        for name in entries:
            getattr(lib, name).restype = None
        self._norm = {torch.float32: lib.rmsnorm_f32, torch.bfloat16: lib.rmsnorm_bf16}
        self._rope = {torch.float32: lib.rope_f32, torch.bfloat16: lib.rope_bf16}
        self._argmax = {torch.float32: lib.argmax_f32, torch.bfloat16: lib.argmax_bf16}
        self._rope_pairs = {torch.float32: lib.rope_interleaved_f32, torch.bfloat16: lib.rope_interleaved_bf16}
        self._combine = {torch.float32: lib.moe_combine_f32, torch.bfloat16: lib.moe_combine_bf16}
        self._route = {torch.float32: lib.moe_route_f32, torch.bfloat16: lib.moe_route_bf16}

    @classmethod
    def build(cls, flags: tuple[str, ...] = ("-march=native",)) -> PointwiseKernels:
        return cls(build(SOURCE, flags))

    def norm_entry(self, dtype: torch.dtype) -> Any | None:
        """The add + RMSNorm C entry point for `dtype` (engine.kernels.program calls it directly), or None."""
        return self._norm.get(dtype)

    def rope_entry(self, dtype: torch.dtype) -> Any | None:
        """The in-place RoPE C entry point for `dtype`, or None."""
        return self._rope.get(dtype)

    def rope_pairs_entry(self, dtype: torch.dtype) -> Any | None:
        """The in-place RoPE on interleaved pairs (`rotary_interleaved`'s) for `dtype`, or None."""
        return self._rope_pairs.get(dtype)

    def route_entry(self, dtype: torch.dtype) -> Any | None:
        """The MoE routing entry point (`route`'s) for rows of `dtype`, or None."""
        return self._route.get(dtype)

    def combine_entry(self, dtype: torch.dtype) -> Any | None:
        """The MoE combine entry point (`moe_combine`'s) for rows of `dtype`, or None."""
        return self._combine.get(dtype)

    @staticmethod
    def takes(x: torch.Tensor, *others: torch.Tensor) -> bool:
        dtype = x.dtype  # NOTE: asked a few times a layer each step, so no generator: a loop is half the cost
        if dtype not in _DTYPES or x.device.type != "cpu":
            return False
        for o in others:  # noqa: SIM110 (see the note above)
            if o.dtype != dtype:
                return False
        return True

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dim = x.shape[-1]
        x2 = x.contiguous()
        r2 = residual.contiguous() if residual is not None else None
        out = torch.empty_like(x2)
        total = torch.empty_like(x2) if r2 is not None else x2
        self._norm[x.dtype](
            x2.numel() // dim if dim else 0, dim, x2.data_ptr(), r2.data_ptr() if r2 is not None else None,
            weight.contiguous().data_ptr(), eps, out.data_ptr(), total.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out, total

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`rotary.apply_rotary(x, cos, sin)` computed in place: x [T, heads, D] (token rows may be strided, heads
        contiguous), cos/sin [T, 1, D] in x's dtype. Anything else goes to the torch code."""
        t, heads, d = x.shape
        if not (self.takes(x, cos, sin) and x.stride(2) == 1 and x.stride(1) == d and d % 2 == 0 and t):
            return apply_rotary(x, cos, sin)
        c, s = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
        self._rope[x.dtype](t, heads, d, x.data_ptr(), x.stride(0), c.data_ptr(), s.data_ptr(), torch.get_num_threads())
        return x

    def rotary_interleaved(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply_rotary_interleaved(x, cos, sin)` computed in place: x [T, heads, D] or [T, D] (token rows and
        heads may be strided, each head contiguous), cos/sin [T, 1, D] or [T, D] in x's dtype."""
        x3 = x.unsqueeze(1) if x.dim() == 2 else x
        t, heads, d = x3.shape
        if not (self.takes(x, cos, sin) and x3.stride(2) == 1 and d % 2 == 0 and t and cos.numel() == t * d):
            return apply_rotary_interleaved(x, cos, sin)
        c, s = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
        self._rope_pairs[x.dtype](t, heads, d, x3.data_ptr(), x3.stride(0), x3.stride(1), c.data_ptr(), s.data_ptr(),
                                  torch.get_num_threads())  # fmt: skip
        return x

    def moe_combine(
        self, ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None, tokens: int
    ) -> torch.Tensor:
        """`moe_combine(...)` (same arguments, same bits) in one pass."""
        fn = self._combine.get(ys.dtype)
        takes = fn is not None and ys.device.type == "cpu" and weights.dtype == torch.float32
        if not takes or (shared is not None and shared.dtype != ys.dtype):
            return moe_combine(ys, order, weights, shared, tokens)
        y, o, w = ys.contiguous(), order.to(torch.int64).contiguous(), weights.contiguous()
        sh = shared.contiguous() if shared is not None else None
        out = y.new_empty(tokens, y.shape[1])
        got = fn(tokens, w.shape[1], y.shape[1], y.shape[0], o.data_ptr(), y.data_ptr(), w.data_ptr(),
                 sh.data_ptr() if sh is not None else None, out.data_ptr(), torch.get_num_threads())  # fmt: skip
        if got != 0:
            raise MemoryError("the MoE combine found no memory for its row index")
        return out

    def route(
        self, x: torch.Tensor, gate: RouterSpec
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A MoE layer's routing of x [T, H] (float32 or bf16) as `gate` (engine.layers.moe.MoEGate: its weight
        [E, H] float32, top_k, scoring, groups, bias, scale) routes it, and its (token, choice) pairs grouped by
        expert: (weights [T, K] float32, ids [T, K], order [T * K], counts [E], xs [T * K, H]) as MoEGate's weights
        and ids, a stable argsort of ids, their bincount and x's rows in that order (pointwise.c's moe_route: its
        float32 sums are its own, so a near tie may fall the other way)."""
        t, h = x.shape
        x2, w, k = x.contiguous(), gate.weight.contiguous(), gate.top_k  # (held: the C call reads them)
        assert self.routes(x, gate), "route takes float32 or bf16 rows and a float32 [E <= 4096, H] router"
        bias = getattr(gate, "e_score_correction_bias", None)
        bias = bias.float().contiguous() if bias is not None and gate.scoring == "sigmoid" else None
        weights = torch.empty(t, k, dtype=torch.float32)
        ids = torch.empty(t, k, dtype=torch.int64)
        order = torch.empty(t * k, dtype=torch.int64)
        counts = torch.empty(w.shape[0], dtype=torch.int64)
        xs = x2.new_empty(t * k, h)
        cfg = route_config(gate)
        self._route[x.dtype](t, h, w.shape[0], k, x2.data_ptr(), w.data_ptr(),
                             bias.data_ptr() if bias is not None else None, cfg.data_ptr(),
                             gate.routed_scaling_factor, weights.data_ptr(), ids.data_ptr(), order.data_ptr(),
                             counts.data_ptr(), xs.data_ptr(), torch.get_num_threads())  # fmt: skip
        return weights, ids, order, counts, xs

    def routes(self, x: torch.Tensor, gate: RouterSpec) -> bool:
        """Whether `route` takes these: rows of a dtype it has, a float32 router of <= 4,096 experts as wide."""
        w = gate.weight
        e = w.shape[0]
        fits = w.dtype == torch.float32 and w.dim() == 2 and w.shape[1] == x.shape[-1] and e % gate.num_groups == 0
        picks = 0 < gate.top_k <= e <= 4096 and 0 < gate.topk_groups <= gate.num_groups
        # a sigmoid router ranks a group by its two best: groups of one expert are torch's error, not ours
        picks = picks and (gate.scoring != "sigmoid" or gate.num_groups == 1 or e // gate.num_groups >= 2)
        return x.dtype in self._route and x.dim() == 2 and fits and picks and gate.scoring in ("softmax", "sigmoid")

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax(logits, dim=-1) for [B, V] float32 or bf16 logits."""
        fn = self._argmax.get(logits.dtype)
        if fn is None or logits.dim() != 2 or logits.device.type != "cpu":
            return logits.argmax(dim=-1)
        x = logits.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        fn(x.shape[0], x.shape[1], x.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out

    def sample(self, logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """engine.sampler.inverse_cdf: one token per row of [B, V] logits (CPU; read as float32) at uniform
        numbers u [B]."""
        assert logits.dim() == 2 and logits.device.type == "cpu", "sample takes [B, V] logits on the CPU"
        x = logits.to(torch.float32).contiguous()
        uu = u.to(torch.float64).contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        n = torch.get_num_threads()
        self.lib.sample_f32(x.shape[0], x.shape[1], x.data_ptr(), uu.data_ptr(), out.data_ptr(), n)
        return out


def check_sample(k: PointwiseKernels) -> None:
    """Each row's draw at the middle of chosen tokens' CDF intervals (float64 reference) must be that token; u = 0
    takes the first token with weight, u just under 1 the last; tokens at -inf are never drawn."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 1000, generator=g) * 3
    logits[1, ::3] = float("-inf")  # masked: zero weight
    logits[2, :995] = float("-inf")  # five tokens left, in the last (partial) block
    w = (logits.double() - logits.double().max(dim=-1, keepdim=True).values).exp()
    cdf = w.cumsum(dim=-1) / w.sum(dim=-1, keepdim=True)
    for r in range(logits.shape[0]):
        allowed = torch.nonzero(w[r] > 0).flatten().tolist()
        picks = [allowed[0], allowed[len(allowed) // 2], allowed[-1], *allowed[1 : len(allowed) : 97]]
        for tok in picks:
            lo = cdf[r, tok - 1].item() if tok else 0.0
            if cdf[r, tok].item() - lo < 1e-6:
                continue  # an interval too narrow for float32 weights to place u inside it reliably
            u = torch.zeros(logits.shape[0], dtype=torch.float64)
            u[r] = (lo + cdf[r, tok].item()) / 2
            if k.sample(logits, u)[r].item() != tok:
                raise SelfCheckError(f"self-check failed for sampling: row {r}, token {tok}")
        ends = k.sample(logits[r : r + 1].expand(2, -1), torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
        if ends.tolist() != [allowed[0], allowed[-1]]:
            raise SelfCheckError(f"self-check failed for sampling at the ends of row {r}")


def self_check(k: PointwiseKernels) -> None:
    """Each op against its torch definition on both dtypes: vector tails, one row and many."""
    g = torch.Generator().manual_seed(0)
    for dtype in _DTYPES:
        for rows, dim in ((1, 37), (3, 64), (70, 200)):
            x, r = (torch.randn(rows, dim, generator=g).to(dtype) for _ in range(2))
            w = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            for res in (None, r):
                pairs += zip(k.rms_norm(x, res, w, 1e-6), rms_norm(x, res, w, 1e-6), strict=True)
            if dim % 2 == 0:
                xr = torch.randn(rows, 3, dim, generator=g).to(dtype)
                cos, sin = (torch.randn(rows, 1, dim, generator=g).to(dtype) for _ in range(2))
                pairs.append((k.rotary(xr.clone(), cos, sin), apply_rotary(xr, cos, sin)))
            for got, want in pairs:
                if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-5):
                    raise SelfCheckError(f"self-check failed for {dtype} {rows}x{dim}")
    logits = torch.randn(5, 1000, generator=g)
    logits[1, 7] = logits[1, 900] = 1e9  # a tie: the first wins
    logits[3, 500] = float("nan")  # a NaN wins, as in torch
    for x in (logits, logits.bfloat16()):
        if not torch.equal(k.argmax(x), x.argmax(dim=-1)):
            raise SelfCheckError(f"self-check failed for argmax over {x.dtype}")
    check_sample(k)


# The process-wide kernels built for this CPU, or None (logged once) where they cannot be built.
kernel = Once(PointwiseKernels.build, log, "RMSNorm and greedy argmax will run as torch ops (slower)", check=self_check)
