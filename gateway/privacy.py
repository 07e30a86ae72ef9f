"""The privacy policy in the request path: prompts screened before the model sees them, answers as they stream.

`Privacy` (one per gateway) holds the detectors, the term lists (re-read when their files change) and every
tenant's policy. `Privacy.session(tenant, state)` gives one request its `PrivacySession`: the tenant's policy,
the term lists' current versions, the vault of its placeholders, and the counters the audit event reports
(`state.policy_hits`: direction, policy, action → count; never what matched).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine import RequestOutput
from gateway import offload
from gateway.errors import APIError, error_body
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.settings import PrivacySettings, SettingsError
from gateway.state import RequestState
from security.pii_detectors import DEFAULT_PASSPORT, NAMES, Detector, detectors
from security.pii_policy import DirectionPolicy, PolicyBook, TenantPolicy
from security.pii_redact import Vault, redact
from security.pii_scan import Scanner
from security.pii_stream import Restorer, StreamFilter
from security.pii_terms import TermList, TermListError

log = logging.getLogger("tianmen.privacy")
SCANNER_CACHE_SIZE = 256  # (tenant policy, term-list versions) pairs whose scanners are kept

Body = ChatCompletionRequest | CompletionRequest


class Privacy:
    def __init__(
        self,
        book: PolicyBook,
        dets: Sequence[Detector],
        lists: dict[str, TermList] | None = None,
        check_interval_s: float = 2.0,
    ) -> None:
        self.book, self.detectors = book, tuple(dets)
        self.lists = dict(lists or {})
        self.check_interval_s = check_interval_s
        self._watcher: asyncio.Task[None] | None = None
        # a tenant policy and one version of each term list → its (prompt, completion) scanners, built once.
        # Keyed by identity; the value holds the objects, so an id cannot be reused while its entry lives
        self._scanners: dict[tuple[int, ...], tuple[object, tuple[object, ...], Scanner, Scanner]] = {}

    def session(self, tenant: str | None, state: RequestState) -> PrivacySession:
        policy = self.book.for_tenant(tenant)
        terms = [(name, tl.matcher) for name, tl in self.lists.items()]  # this request's versions
        matchers = tuple(m for _, m in terms)
        key = (id(policy), *map(id, matchers))
        hit = self._scanners.get(key)
        if hit is None:
            if len(self._scanners) >= SCANNER_CACHE_SIZE:  # term lists reloaded many times: start over
                self._scanners.clear()
            prompt = _scanner(policy.prompt, self.detectors, terms)
            hit = self._scanners[key] = (policy, matchers, prompt, _scanner(policy.completion, self.detectors, terms))
        return PrivacySession(policy, hit[2], hit[3], state)

    async def start(self) -> None:
        if self.lists:
            self._watcher = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            for tl in self.lists.values():
                try:
                    await asyncio.to_thread(tl.refresh)  # the rebuild runs off the loop; the swap is one assignment
                except Exception as e:  # never let the watcher die: the old list stays in use
                    log.error("term list %r: reload failed: %s", tl.name, type(e).__name__)


def build_privacy(p: PrivacySettings) -> Privacy:
    """From `[privacy]`; a SettingsError names the bad entry."""
    try:
        lists: dict[str, TermList] = {}
        for name, path in (p.term_lists or {}).items():
            if name in NAMES or name == "*" or not isinstance(path, str):
                raise ValueError(f"term_lists.{name}: a name other than the detectors' ({', '.join(NAMES)}) = a path")
            lists[name] = TermList(name, Path(path).expanduser())
        dets = detectors(p.passport_pattern or DEFAULT_PASSPORT)
        keep = {d.name: d.keep for d in dets}
        book = PolicyBook([*NAMES, *lists], p.default, p.tenants, p.mask, keep)
    except (TermListError, ValueError) as e:
        raise SettingsError(f"privacy: {e}") from None
    return Privacy(book, dets, lists, p.terms_check_interval_s)


class PrivacySession:
    """One request: its tenant's policy, one version of each term list, its placeholders, its counters."""

    def __init__(self, policy: TenantPolicy, prompt: Scanner, completion: Scanner, state: RequestState) -> None:
        self.policy, self.state = policy, state
        self.vault = Vault()
        self.prompt_scanner, self.completion_scanner = prompt, completion

    def record(self, direction: str, fired: Counter[tuple[str, str]]) -> None:
        hits = self.state.policy_hits
        for (policy, action), n in fired.items():
            key = (direction, policy, action)
            hits[key] = hits.get(key, 0) + n

    # ---- prompts ---------------------------------------------------------------------------------------
    def screen_text(self, text: str, param: str) -> str:
        if not text or self.prompt_scanner.empty:
            return text
        hits, _ = self.prompt_scanner.scan(text)
        if not hits:
            return text
        r = redact(text, hits, self.policy.prompt, self.vault)
        if r.blocked is not None:
            self.state.error = "content_policy"
            self.record("prompt", Counter({(r.blocked, "block"): 1}))
            raise APIError(
                400,
                f"the prompt was refused by the content policy {r.blocked!r} (action: block)",
                param=param,
                code="content_policy_violation",
            )
        self.record("prompt", r.fired)
        return r.text

    def screen(self, body: Body, tokenizer: Any) -> Body:
        """The body the model will see: every message (or the prompt) through the prompt policy; a block is a 400."""
        if self.prompt_scanner.empty:
            return body
        if isinstance(body, ChatCompletionRequest):
            messages = list(body.messages)
            changed = False
            for i, m in enumerate(messages):
                text = m.text()  # content parts are screened joined: a number split over two parts is still found
                new = self.screen_text(text, f"messages.{i}.content")
                if new != text:
                    messages[i] = m.model_copy(update={"content": new})
                    changed = True
            return body.model_copy(update={"messages": messages}) if changed else body
        ids = body.token_ids()
        text = tokenizer.decode(ids, skip_special_tokens=False) if ids is not None else body.text()
        new = self.screen_text(text, "prompt")
        return body.model_copy(update={"prompt": new}) if new != text else body

    async def screen_async(self, body: Body, tokenizer: Any) -> Body:
        size = sum(len(m.text()) for m in body.messages) if isinstance(body, ChatCompletionRequest) else 0
        if isinstance(body, CompletionRequest):
            size = len(body.prompt) if body.token_ids() is not None else len(body.text())
        return await offload.run(size, self.screen, body, tokenizer)

    # ---- completions -----------------------------------------------------------------------------------
    def check_request(self, body: Body) -> None:
        """Token logprobs carry the raw token texts: they would bypass a completion policy that rewrites."""
        if body.num_logprobs() is not None and self.policy.completion.transforms:
            raise APIError(
                400,
                "logprobs cannot be returned under this tenant's completion content policy (token texts would "
                "bypass it)",
                param="logprobs",
                code="unsupported_parameter",
            )

    def completion(self, n: int) -> CompletionGuard | None:
        if self.completion_scanner.empty and not self.vault.originals:
            return None
        return CompletionGuard(self, n)


def _scanner(policy: DirectionPolicy, dets: Sequence[Detector], terms: Sequence[tuple[str, Any]]) -> Scanner:
    active = policy.active()
    return Scanner([d for d in dets if d.name in active], [(n, m) for n, m in terms if n in active])


class CompletionGuard:
    """Each choice's deltas through the completion policy, then its placeholders restored.

    `apply` rewrites a batch of (choice, delta): the text becomes what may be sent now; a blocked choice ends
    with finish_reason "content_filter" and later deltas only carry its usage (so tokens are still counted)."""

    def __init__(self, session: PrivacySession, n: int) -> None:
        self.session = session
        self.filters = [StreamFilter(session.completion_scanner, session.policy.completion) for _ in range(n)]
        self.restorers = [Restorer(session.vault) for _ in range(n)]
        self.ended = [False] * n
        # only audit (the default): the text is counted, never held back; the stream is what it was without us
        self.passthrough = not session.policy.completion.transforms
        self.unscanned: list[list[str]] = [[] for _ in range(n)]  # passthrough: each choice's text until it ends

    def apply(self, ready: list[tuple[int, RequestOutput]]) -> list[tuple[int, RequestOutput]]:
        return [(i, self._one(i, out)) for i, out in ready]

    def _one(self, i: int, out: RequestOutput) -> RequestOutput:
        f, restorer = self.filters[i], self.restorers[i]
        if self.passthrough:  # nothing is held back, so the text is scanned once, when the choice ends
            self.unscanned[i].append(out.new_text)
            if out.finished:
                self._count(i)
            text = restorer.feed(out.new_text) + (restorer.finish() if out.finished else "")
            return out if text == out.new_text else replace(out, new_text=text)
        if self.ended[i]:  # blocked before: count its tokens, send nothing
            return replace(out, new_text="", finish_reason=None, logprobs=None, stop_reason=None)
        text = f.feed(out.new_text)
        if out.finished and f.blocked is None:
            text += f.finish()
        self.session.record("completion", f.take_fired())
        if f.blocked is not None:
            self.ended[i] = True
            self.session.state.error = "content_policy"
            return replace(out, new_text=restorer.feed(text) + restorer.finish(), finish_reason="content_filter")
        text = restorer.feed(text)
        if out.finished:
            text += restorer.finish()
        return replace(out, new_text=text)

    def _count(self, i: int) -> None:
        f = self.filters[i]
        f.pending += "".join(self.unscanned[i])
        self.unscanned[i].clear()
        f.finish()
        self.session.record("completion", f.take_fired())

    def close(self) -> None:
        """The request ended (or was cut): what an audit-only policy has not yet scanned is counted now."""
        if self.passthrough:
            for i in range(len(self.filters)):
                self._count(i)

    @property
    def blocked(self) -> str | None:
        return next((f.blocked for f in self.filters if f.blocked is not None), None)

    def error(self) -> dict[str, Any]:
        """The in-band error that ends a blocked stream: names the policy, never the text."""
        return error_body(
            400,
            f"the completion was stopped by the content policy {self.blocked!r} (action: block)",
            code="content_filter",
        )

    def audit_text(self) -> str:
        """What the trail may keep of the answers: rewritten, placeholders not restored."""
        if self.passthrough:  # the text is the model's: what was counted, and what a cut stream left uncounted
            return "".join(f.text + f.pending + "".join(u) for f, u in zip(self.filters, self.unscanned))
        return "".join(f.text for f in self.filters)
