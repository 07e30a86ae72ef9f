"""The AMX prefill attention of whole prompts (engine.kernels.prefill_attn_amx), compiled here with gcc, against
float32 SDPA; the attention layer's use of it; and its choice by measurement (engine.kernels.op_choice).

It is a candidate only on CPUs with AMX tiles, so these tests run where the CPU has them; elsewhere the layer
never sees it (SDPA's path is what the rest of the suite tests)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.context import AttentionContext, PrefillMeta, reset_context, set_context
from engine.kernels import amxmm, cbuild
from engine.kernels.op_choice import PREFILL_LENGTHS, choose_prefill_attention
from engine.kernels.prefill_attn_amx import PrefillAttention, reference, self_check
from engine.layers.attention import PagedAttention

pytestmark = pytest.mark.skipif(not amxmm.supported(), reason="this CPU has no AMX tiles")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> PrefillAttention:
    mp = pytest.MonkeyPatch()
    mp.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path_factory.mktemp("kernels")))
    try:
        return PrefillAttention.build()
    finally:
        mp.undo()


def projected(n: int, s: int, h: int, kv: int, d: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v as the attention layer gets them: strided views of one QKV projection's bf16 rows."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n * s, (h + 2 * kv) * d, generator=g).bfloat16()
    q, k, v = qkv.split([h * d, kv * d, kv * d], -1)
    return q.view(-1, h, d), k.view(-1, kv, d), v.view(-1, kv, d)


# prompt lengths around a 16-token block and a 32-key group, one long enough to split into parts of equal causal
# work (one prompt, fewer KV heads than 4 tasks a thread); G = 1, 3, 7, 8, 16; head_dim 32 to 256
@pytest.mark.parametrize(
    ("n", "s", "h", "kv", "d"),
    [(1, 1, 2, 2, 64), (2, 15, 9, 3, 64), (3, 16, 9, 3, 64), (2, 17, 14, 2, 64), (1, 31, 8, 1, 32),
     (4, 33, 16, 1, 64), (3, 100, 32, 4, 128), (1, 1000, 9, 3, 64), (2, 70, 8, 2, 256)],
)  # fmt: skip
def test_equals_float32_sdpa(kernel: PrefillAttention, n: int, s: int, h: int, kv: int, d: int) -> None:
    q, k, v = projected(n, s, h, kv, d)
    got = kernel(q, k, v, n, d**-0.5)
    assert got.shape == (n * s, h, d) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(q, k, v, n, d**-0.5), rtol=2e-2, atol=2e-2)


def test_a_token_never_sees_later_ones(kernel: PrefillAttention) -> None:
    q, k, v = projected(1, 40, 9, 3, 64)
    before = kernel(q, k, v, 1, 0.125)
    k[25:], v[25:] = torch.randn(15, 3, 64), torch.randn(15, 3, 64)  # views of the same rows: later tokens change
    assert torch.equal(kernel(q, k, v, 1, 0.125)[:25], before[:25])


def test_a_prompt_never_reads_the_next_ones_rows(kernel: PrefillAttention) -> None:
    q, k, v = projected(2, 23, 9, 3, 64)  # 23: the last block and key group of a prompt are partial
    before = kernel(q, k, v, 2, 0.125)
    k[23:], v[23:] = float("nan"), float("nan")
    assert torch.equal(kernel(q, k, v, 2, 0.125)[:23], before[:23])


def test_takes_only_what_the_tiles_fit() -> None:
    assert PrefillAttention.takes(14, 2, 64, torch.bfloat16) and PrefillAttention.takes(8, 8, 256, torch.bfloat16)
    assert not PrefillAttention.takes(14, 2, 64, torch.float32)
    assert not PrefillAttention.takes(14, 2, 48, torch.bfloat16)  # head_dim not a multiple of 32
    assert not PrefillAttention.takes(8, 2, 288, torch.bfloat16)  # past MAX_D
    assert not PrefillAttention.takes(9, 2, 64, torch.bfloat16)  # heads not whole groups


def test_self_check_catches_a_wrong_kernel(kernel: PrefillAttention, monkeypatch: pytest.MonkeyPatch) -> None:
    self_check(kernel)
    monkeypatch.setattr(PrefillAttention, "__call__", lambda self, q, *args: q * 1.1)
    with pytest.raises(cbuild.SelfCheckError, match="self-check failed"):
        self_check(kernel)


def _counting(monkeypatch: pytest.MonkeyPatch, entry: str) -> list[int]:
    """The query rows of each call of PrefillAttention's `entry` from now on."""
    calls: list[int] = []
    original = getattr(PrefillAttention, entry)
    monkeypatch.setattr(PrefillAttention, entry, lambda self, q, *a: calls.append(q.shape[0]) or original(self, q, *a))
    return calls


def _whole_prompts(layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
    t = q.shape[0]
    layer.k_cache = torch.zeros(t // 16 + 2, 16, layer.num_kv_heads, layer.head_dim, dtype=q.dtype)
    layer.v_cache = torch.zeros_like(layer.k_cache)
    set_context(AttentionContext(torch.arange(t), 0, None, None, [PrefillMeta(0, t, t // n, None, None, n)]))
    try:
        return layer(q, k, v)
    finally:
        reset_context()


def test_the_layer_takes_it_for_whole_prompts_up_to_its_limit(
    kernel: PrefillAttention, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counting(monkeypatch, "__call__")
    layer = PagedAttention(9, 3, 64, 0.125)
    sdpa = _whole_prompts(layer, *projected(2, 40, 9, 3, 64), 2)
    layer.prefill_kernel, layer.prefill_up_to = kernel, 40
    ours = _whole_prompts(layer, *projected(2, 40, 9, 3, 64), 2)
    assert calls == [80]
    torch.testing.assert_close(ours.float(), sdpa.float(), rtol=2e-2, atol=2e-2)
    layer.prefill_up_to = 39  # prompts of 40 tokens are past the limit: SDPA
    _whole_prompts(layer, *projected(2, 40, 9, 3, 64), 2)
    assert calls == [80]


def test_the_choice_keeps_it_up_to_the_longest_length_it_won_at_every_step(kernel: PrefillAttention) -> None:
    layer = PagedAttention(9, 3, 64, 0.125)

    def timer_losing_from(tokens: int) -> Callable[[Callable[[], object]], float]:
        def timer(fn: Callable[[], object]) -> float:  # the kernel's probe: the layer copy that holds it
            rows = fn.rows  # type: ignore[attr-defined]
            ours = fn.prefill is not None  # type: ignore[attr-defined]
            return 1e-3 if ours == (rows < tokens) else 1.0

        return timer

    assert choose_prefill_attention(kernel, layer, torch.bfloat16, timer_losing_from(512), None) == (kernel, 128)
    assert choose_prefill_attention(kernel, layer, torch.bfloat16, timer_losing_from(32), None) == (None, 0)
    assert choose_prefill_attention(kernel, layer, torch.bfloat16, timer_losing_from(10**6), None) == (
        kernel, PREFILL_LENGTHS[-1])  # fmt: skip
    assert choose_prefill_attention(kernel, layer, torch.bfloat16, None, None) == (kernel, PREFILL_LENGTHS[-1])
    assert choose_prefill_attention(kernel, layer, torch.float32, None, None) == (None, 0)  # bf16 only
    assert choose_prefill_attention(None, layer, torch.bfloat16, None, None) == (None, 0)


# a chunk after cached tokens (a prefix-cache hit, an earlier chunk): its keys, its own among them, in the paged
# cache, scattered blocks of 16 or 32 tokens, stale NaN memory past the context
@pytest.mark.parametrize(
    ("cached", "s", "h", "kv", "d", "bs"),
    [(16, 30, 9, 3, 64, 16), (5, 1, 14, 2, 64, 16), (100, 47, 8, 2, 128, 32), (31, 200, 16, 1, 32, 16),
     (0, 40, 4, 4, 64, 32), (700, 64, 9, 3, 64, 16)],
)  # fmt: skip
def test_a_chunk_after_cached_tokens_equals_float32_attention(
    kernel: PrefillAttention, cached: int, s: int, h: int, kv: int, d: int, bs: int
) -> None:
    g = torch.Generator().manual_seed(1)
    ctx = cached + s
    blocks = -(-ctx // bs)
    kc, vc = (torch.randn(blocks + 3, bs, kv, d, generator=g).bfloat16() for _ in range(2))
    kc[-1], vc[-1] = float("nan"), float("nan")  # never in the table
    ids = torch.randperm(blocks + 2, generator=g)[:blocks]
    last = ids[-1]
    kc[last, (ctx - 1) % bs + 1 :], vc[last, (ctx - 1) % bs + 1 :] = float("nan"), float("nan")  # past the context
    q = torch.randn(s, h, d, generator=g).bfloat16()
    keys = kc[ids].reshape(-1, kv, d)[:ctx].float().transpose(0, 1)[None]
    values = vc[ids].reshape(-1, kv, d)[:ctx].float().transpose(0, 1)[None]
    mask = torch.arange(ctx) <= torch.arange(cached, ctx).unsqueeze(1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], keys, values, attn_mask=mask, scale=d**-0.5, enable_gqa=h != kv
    )[0].transpose(0, 1)
    got = kernel.paged(q, kc, vc, ids, ctx, d**-0.5)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_the_layer_takes_it_for_a_chunk_after_cached_tokens(
    kernel: PrefillAttention, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counting(monkeypatch, "paged")
    layer = PagedAttention(9, 3, 64, 0.125, (torch.empty(0).bfloat16(), torch.empty(0).bfloat16()))
    layer.k_cache, layer.v_cache = (torch.randn(8, 16, 3, 64).bfloat16() for _ in range(2))
    q, k, v = projected(1, 20, 9, 3, 64)
    ids = torch.tensor([5, 2, 7, 0])  # 30 cached tokens, then these 20 (written to the cache by the layer)
    slots = torch.tensor([int(ids[p // 16]) * 16 + p % 16 for p in range(30, 50)])
    mask = torch.arange(50) <= torch.arange(30, 50).unsqueeze(1)

    def run() -> torch.Tensor:
        set_context(AttentionContext(slots, 0, None, None, [PrefillMeta(0, 20, 50, ids, mask)]))
        try:
            return layer(q, k, v)
        finally:
            reset_context()

    sdpa = run()
    layer.prefill_kernel, layer.prefill_up_to = kernel, 32
    ours = run()
    assert calls == [20]
    torch.testing.assert_close(ours.float(), sdpa.float(), rtol=2e-2, atol=2e-2)
