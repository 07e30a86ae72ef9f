from __future__ import annotations

import math

import torch

from engine.params import SamplingParams
from engine.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]])
    tokens, lps = Sampler()(logits, [SamplingParams(temperature=0)] * 2, [None, None])
    assert tokens == [1, 0] and lps is None


def test_seeded_row_is_independent_of_batch() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, 1000)
    others = torch.randn(5, 1000)
    p = SamplingParams(temperature=0.9, seed=42)
    alone = [Sampler()(row, [p], [gen(42)])[0][0] for _ in range(1)]
    g = gen(42)
    seq_alone = [Sampler()(row, [p], [g])[0][0] for _ in range(10)]
    g, gs = gen(42), [gen(i) for i in range(5)]
    seq_batched = []
    for _ in range(10):
        batch = torch.cat([others[:2], row, others[2:]])
        params = [SamplingParams(temperature=1.3)] * 2 + [p] + [SamplingParams(temperature=0.5, top_k=5)] * 3
        toks, _ = Sampler()(batch, params, [gs[0], gs[1], g, gs[2], gs[3], gs[4]])
        seq_batched.append(toks[2])
    assert seq_alone == seq_batched and seq_alone[0] == alone[0]
    assert len(set(seq_alone)) > 1  # it really samples


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    g = gen(1)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[Sampler()(logits, [SamplingParams(temperature=1.0)], [g])[0][0]] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_top_k_top_p_min_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]] * 3))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(min_p=0.4)]
    out = apply_top_k_top_p_min_p(logits, params)
    keep = torch.isfinite(out).tolist()
    assert keep[0] == [True, True, False, False]
    assert keep[1] == [True, True, False, False]  # 0.5 < 0.7, then 0.75 >= 0.7 stops after the 2nd
    assert keep[2] == [True, True, False, False]  # >= 0.4 * 0.5
    assert torch.equal(out[0, :2], logits[0, :2])


def test_top_p_always_keeps_the_best_token() -> None:
    logits = torch.log(torch.tensor([[0.9, 0.1]]))
    out = apply_top_k_top_p_min_p(logits, [SamplingParams(top_p=0.05)])
    assert torch.isfinite(out).tolist() == [[True, False]]


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    rep = apply_penalties(logits.clone(), [SamplingParams(repetition_penalty=2.0)], [[0]], [[1]])
    assert rep.tolist() == [[1.0, -4.0, 1.0, 1.0]]
    pf = apply_penalties(
        logits.clone(), [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [[0]], [[2, 2, 3]]
    )
    assert pf.tolist() == [[2.0, -2.0, 1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25]]


def test_logprobs_are_raw_and_top_n_sorted() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    tokens, lps = Sampler()(logits, [SamplingParams(temperature=0, logprobs=2)], [None])
    ref = torch.log_softmax(logits, -1)[0]
    assert tokens == [2] and lps is not None
    assert math.isclose(lps[0].logprob, ref[2].item(), rel_tol=1e-6)
    assert [t for t, _ in lps[0].top] == [2, 1]


def test_logit_bias_forces_and_bans_tokens_under_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    best = logits.argmax(dim=-1).tolist()
    forced = 7 if best[0] != 7 else 8
    params = [
        SamplingParams(temperature=0, logit_bias={forced: 100}),
        SamplingParams(temperature=0, logit_bias={best[1]: -100}),
    ]
    tokens, _ = Sampler()(logits, params, [None, None])
    assert tokens[0] == forced
    assert tokens[1] != best[1] and tokens[1] == logits[1].topk(2).indices[1].item()
    assert logits.argmax(dim=-1).tolist() == best  # the caller's logits are untouched


def test_logit_bias_leaves_rows_without_one_unchanged() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 60)
    plain = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8, seed=3, logprobs=3)] * 2
    biased = [plain[0], SamplingParams(temperature=0.8, seed=3, logprobs=3, logit_bias={5: 100}), plain[2], plain[3]]
    gens_a = [None, gen(1), None, gen(2)]
    gens_b = [None, gen(1), None, gen(2)]
    for _ in range(5):
        ta, la = Sampler()(logits, plain, gens_a)
        tb, lb = Sampler()(logits, biased, gens_b)
        assert tb[1] == 5
        assert [ta[i] for i in (0, 2, 3)] == [tb[i] for i in (0, 2, 3)]
        assert la is not None and lb is not None
        assert [la[i] for i in (0, 2, 3)] == [lb[i] for i in (0, 2, 3)]


def test_logit_bias_bans_a_token_when_sampling() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    g = gen(4)
    p = SamplingParams(temperature=1.0, logit_bias={0: -100})
    assert {Sampler()(logits, [p], [g])[0][0] for _ in range(300)} == {1, 2}


def test_reported_logprobs_include_the_bias() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    bias = {3: 10.0}
    tokens, lps = Sampler()(logits, [SamplingParams(temperature=0, logprobs=1, logit_bias=bias)], [None])
    ref = torch.log_softmax(logits + torch.tensor([0.0, 0.0, 0.0, 10.0]), -1)[0]
    assert tokens == [3] and lps is not None
    assert math.isclose(lps[0].logprob, ref[3].item(), rel_tol=1e-6) and lps[0].top[0][0] == 3


def test_top_k_past_the_vocabulary_keeps_everything() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    out = apply_top_k_top_p_min_p(logits, [SamplingParams(top_k=2**62)])
    assert torch.equal(out, logits)


def test_inverse_cdf_never_picks_a_masked_token_even_at_the_ends() -> None:
    from engine.sampler import inverse_cdf

    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 1.0, float("-inf")]] * 3)
    u = torch.tensor([0.0, 1.0 - 2**-53, 1.0], dtype=torch.float64)  # 1.0 is past the range: still a real token
    assert inverse_cdf(logits, u).tolist() == [1, 3, 3]


def test_inverse_cdf_follows_a_large_vocabulary() -> None:
    from engine.sampler import inverse_cdf

    torch.manual_seed(0)
    logits = torch.randn(1, 50_000) * 3
    probs = torch.softmax(logits, dim=-1)[0]
    n, chunk = 10_000, 200  # chunks keep the [rows, 50k] float64 sums small
    draws = [inverse_cdf(logits.expand(chunk, -1), torch.rand(chunk, dtype=torch.float64)) for _ in range(n // chunk)]
    tokens = torch.cat(draws)
    top = probs.argsort(descending=True)[:5]
    for t in top.tolist():  # the likeliest tokens come up as often as their probability says (4 sigma)
        p = probs[t].item()
        assert abs((tokens == t).float().mean().item() - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_bf16_logits_give_the_tokens_and_logprobs_of_their_float32_widening() -> None:
    """The runner passes the LM head's output in its own dtype: greedy rows that nothing else reads take their
    argmax as it is; every other path (logprobs, penalties, bias, sampling) works on the exact float32 copy."""
    torch.manual_seed(3)
    logits = (torch.randn(4, 300) * 3).bfloat16()
    wide = logits.float()
    cases = [
        [SamplingParams(temperature=0)] * 4,
        [SamplingParams(temperature=0, logprobs=3)] * 4,
        [SamplingParams(temperature=0, repetition_penalty=1.5)] * 4,
        [SamplingParams(temperature=0, logit_bias={5: 3.0})] * 4,
    ]
    for params in cases:
        got, got_lp = Sampler()(logits, params, [None] * 4, [[1, 2]] * 4, [[5]] * 4)
        want, want_lp = Sampler()(wide, params, [None] * 4, [[1, 2]] * 4, [[5]] * 4)
        assert got == want
        assert got_lp == want_lp
    sampled = [SamplingParams(temperature=0.8, seed=1)] * 4
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    gens2 = [torch.Generator().manual_seed(i) for i in range(4)]
    assert Sampler()(logits, sampled, gens)[0] == Sampler()(wide, sampled, gens2)[0]
