from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from engine.outputs import Logprob
from engine.params import SamplingParams

if TYPE_CHECKING:
    from engine.kernels.kernel_set import CpuKernels
    from engine.structured import GrammarMask


class SamplerFn(Protocol):
    """What the model runner samples with (Sampler, or a test's wrapper around it)."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]] = (),
        output_ids: Sequence[Sequence[int]] = (),
        mask: GrammarMask | None = None,
    ) -> tuple[list[int], list[Logprob] | None]: ...


class Sampler:
    """Turns a batch of logits into one token per row.

    Each row draws one uniform number from its own torch.Generator (seeded per request) and inverts its cumulative
    distribution: a row's token never depends on what else is in the batch.
    """

    def __init__(self) -> None:
        # torch.argmax(dim=-1), or a CPU kernel with the same answers (engine.kernels.pointwise)
        self.argmax: Callable[[torch.Tensor], torch.Tensor] = lambda x: x.argmax(dim=-1)
        # inverse_cdf, or the CPU kernel doing it in one pass per row (engine.kernels.pointwise.sample)
        self.inverse_cdf: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = inverse_cdf

    def bind_kernels(self, kernels: CpuKernels) -> None:
        if kernels.argmax is not None:
            self.argmax = kernels.argmax.argmax
        if kernels.sample is not None:
            self.inverse_cdf = kernels.sample.sample

    def __call__(
        self,
        logits: torch.Tensor,  # [B, V], the LM head's dtype
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]] = (),
        output_ids: Sequence[Sequence[int]] = (),
        mask: GrammarMask | None = None,  # structured outputs: the tokens each constrained row's grammar allows
    ) -> tuple[list[int], list[Logprob] | None]:
        if mask is None and all(_argmax_of_raw_logits(p) for p in params):
            # the LM head's dtype as it is: widening bf16 to float32 is exact, so the argmax is the same, and the
            # float32 copy (32 x 151,936 logits: 19 MB written, then read again) is not made
            return self.argmax(logits).tolist(), None
        logits = logits.float()
        if mask is not None:  # first: nothing after it (bias, penalties, temperature) can revive a forbidden token
            logits = mask.apply(logits)
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, params)
        # NOTE: reported logprobs include logit_bias and the grammar mask, as OpenAI's and vLLM's do, but not
        # penalties or temperature
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits.clone(), params, prompt_ids, output_ids)
        if all(p.greedy for p in params):
            tokens = self.argmax(logits)
        else:
            tokens = self._sample(logits, params, generators)
        token_list: list[int] = tokens.tolist()
        if raw_logprobs is None:
            return token_list, None
        return token_list, gather_logprobs(raw_logprobs, token_list, params)

    def _sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
    ) -> torch.Tensor:
        rows = [i for i, p in enumerate(params) if not p.greedy]
        sub = logits[rows] if len(rows) < len(params) else logits
        temps = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype, device=sub.device)
        sub = sub / temps.unsqueeze(1)
        sub = apply_top_k_top_p_min_p(sub, [params[i] for i in rows])
        u = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64, device=sub.device) for i in rows])
        drawn = self.inverse_cdf(sub, u)
        if len(rows) == len(params):
            return drawn  # no greedy row: no argmax over the batch (0.5 ms at 16 x 49k on a 2-core Xeon)
        greedy = self.argmax(logits)
        greedy[rows] = drawn
        return greedy


def _argmax_of_raw_logits(p: SamplingParams) -> bool:
    """The row's token is the argmax of the logits as the model made them, and nothing else reads them."""
    return p.greedy and not p.logit_bias and p.logprobs is None and not p.has_penalties


def inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits` [B, V] drawn from softmax(logits), given one uniform u [B] in [0, 1) per row.

    WHY: an exponential race (argmax p / q, q ~ Exp(1)) draws V random numbers per row; at a 49k vocabulary that
    was most of the sampler's time. This draws one. The running sum is float64: in float32 its rounding over 49k
    terms could shift the boundaries between tokens by ~1e-3 of the mass in the worst case.
    """
    weights = (logits - logits.max(dim=-1, keepdim=True).values).exp_()  # unnormalised; -inf (masked) -> 0
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    # right=True: the first token whose cumulative mass exceeds the target, so a zero-weight token is never picked
    tokens = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)
    # u * total can round up to total itself: then take the last token with weight, not one past the end
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(tokens, last).squeeze(1)


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """A copy of logits with each row's logit_bias added: one scatter for the whole batch, biased rows only."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows.extend([i] * len(p.logit_bias))
            cols.extend(p.logit_bias)
            values.extend(p.logit_bias.values())
    dev = logits.device
    index = (torch.tensor(rows, dtype=torch.long, device=dev), torch.tensor(cols, dtype=torch.long, device=dev))
    return logits.index_put(index, torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """repetition (HF/CTRL, over prompt + output), presence and frequency (OpenAI, over output)."""
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        if not p.has_penalties:
            continue
        out = torch.tensor(output_ids[i], dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        row = logits[i]
        if p.repetition_penalty != 1:
            seen = counts > 0
            if prompt_ids:
                seen[torch.tensor(prompt_ids[i], dtype=torch.long, device=logits.device)] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, penalized, row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
        logits[i] = row
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) the tokens each row's top_k / top_p / min_p exclude. logits: [B, V], already tempered."""
    b, vocab = logits.shape
    dev = logits.device
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=dev).unsqueeze(1)
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if not any(p.top_k > 0 or p.top_p < 1 for p in params):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev).expand(b, vocab)
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=dev).unsqueeze(1)
    drop = ranks >= top_k
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # a token stays while the mass above it is < top_p
    drop |= mass_before >= top_p
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def gather_logprobs(logprobs: torch.Tensor, tokens: list[int], params: Sequence[SamplingParams]) -> list[Logprob]:
    max_n = max((p.logprobs or 0) for p in params)
    top_vals, top_ids = logprobs.topk(max_n, dim=-1) if max_n else (None, None)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1)).squeeze(1).tolist()
    result = []
    for i, p in enumerate(params):
        n = p.logprobs or 0
        top: list[tuple[int, float]] = []
        if n and top_ids is not None and top_vals is not None:
            top = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()))
        result.append(Logprob(tokens[i], chosen[i], top))
    return result
