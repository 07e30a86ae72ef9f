"""Warm-up prompts → token prefixes, prefilled at start and pinned in each named tenant's prefix cache."""

from __future__ import annotations

from typing import Any

from engine import EngineError
from gateway.completion import cache_salt
from gateway.settings import WarmupPrompt


class WarmupError(RuntimeError):
    """A warm-up prompt cannot be pinned; the message names it and says why."""


PROBES = ("A", "B")  # two different user turns: what they share is what every conversation with this start shares


def prefix_ids(tokenizer: Any, w: WarmupPrompt) -> list[int]:
    """The tokens every request starting with `w` begins with, as the routes will tokenize it.

    A chat prefix is rendered by the model's own template with a user turn after it, twice with different
    turns; the tokens both begin with are the prefix (so a template's markup between turns is included, and a
    template that renders the system prompt differently alone changes nothing). A completion prompt loses its
    last token, which may merge with the text that follows it."""
    if w.prompt is not None:
        return list(tokenizer.encode(w.prompt))[:-1]
    messages = w.messages if w.messages is not None else [{"role": "system", "content": w.system or ""}]
    a, b = (list(tokenizer.encode_chat([*messages, {"role": "user", "content": p}])) for p in PROBES)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def warm_up(engine: Any, prompts: list[WarmupPrompt]) -> int:
    """Pin every prompt for each of its tenants (blocking, at start); the tokens pinned, summed.

    The salt is the one the routes derive for a tenant's requests (server.prefix_cache_per_subject = false, which
    the settings require with warm-up prompts). WarmupError names the prompt that the engine refused."""
    pinned = 0
    for i, w in enumerate(prompts):
        try:
            ids = prefix_ids(engine.tokenizer, w)  # InvalidRequestError: the chat template refused the messages
        except EngineError as e:
            raise WarmupError(f"warmup_prompts[{i}]: {e}") from None
        for tenant in w.tenants:
            try:
                pinned += engine.pin_prefix(ids, cache_salt(tenant, "", per_subject=False))
            except EngineError as e:
                raise WarmupError(f"warmup_prompts[{i}] ({len(ids)} tokens): {e}") from None
    return pinned
