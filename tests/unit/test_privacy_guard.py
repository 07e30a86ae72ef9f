"""gateway.privacy's CompletionGuard over real policy objects: what each delta becomes, and what is counted."""

from __future__ import annotations

import random

from engine import RequestOutput, Usage
from gateway.privacy import build_privacy
from gateway.settings import PrivacySettings
from gateway.state import RequestState
from tests import pii_samples as gen


def deltas(text: str, step: int) -> list[RequestOutput]:
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    outs = [RequestOutput("r", [1], p, None, Usage(5, k + 1)) for k, p in enumerate(pieces)]
    outs[-1].finish_reason = "length"
    return outs


def run(settings: PrivacySettings, text: str, step: int, tenant: str = "t") -> tuple[list[str], RequestState, object]:
    state = RequestState("r")
    session = build_privacy(settings).session(tenant, state)
    guard = session.completion(1)
    assert guard is not None
    out = [guard.apply([(0, d)])[0][1] for d in deltas(text, step)]
    return [o.new_text for o in out], state, out[-1]


def test_audit_only_passes_every_delta_through_at_once_and_counts() -> None:
    card = gen.card(random.Random(0))
    text = f"您的卡号是{card}，再见"
    got, state, last = run(PrivacySettings(), text, 3)  # the default: audit for everything
    assert got == [text[i : i + 3] for i in range(0, len(text), 3)]  # nothing held back, nothing changed
    assert state.policy_hits == {("completion", "bank_card", "audit"): 1}
    assert last.finish_reason == "length"  # type: ignore[attr-defined]


def test_audit_only_counts_a_cut_stream_when_it_closes() -> None:
    """Audit-only scans each answer once, at its end; an answer cut before its end is scanned when it closes."""
    card = gen.card(random.Random(2))
    text = f"卡号{card}，以及邮箱 a.b@example.com 然后"
    state = RequestState("r")
    guard = build_privacy(PrivacySettings()).session("t", state).completion(1)
    assert guard is not None
    outs = deltas(text, 4)[:-1]  # the last delta never comes: the client left
    got = [guard.apply([(0, d)])[0][1].new_text for d in outs]
    assert "".join(got) == text[: 4 * len(outs)]  # passed through untouched, as it came
    assert state.policy_hits == {}  # nothing is counted before the answer ends
    guard.close()
    assert state.policy_hits == {("completion", "bank_card", "audit"): 1, ("completion", "email", "audit"): 1}
    guard.close()  # once only
    assert state.policy_hits == {("completion", "bank_card", "audit"): 1, ("completion", "email", "audit"): 1}
    assert guard.audit_text() == "".join(got)


def test_mask_holds_only_the_card_and_block_ends_with_content_filter() -> None:
    card = gen.card(random.Random(1))
    text = f"卡号{card}，谢谢"
    mask = PrivacySettings(default={"completion": {"bank_card": "mask"}})
    got, state, _ = run(mask, text, 2)
    assert "".join(got) == f"卡号{card[:6]}******{card[-4:]}，谢谢" and got[0] == "卡号"
    assert state.policy_hits[("completion", "bank_card", "mask")] == 1
    block = PrivacySettings(default={"completion": {"bank_card": "block"}})
    state = RequestState("r")
    guard = build_privacy(block).session("t", state).completion(1)
    assert guard is not None
    outs = [guard.apply([(0, d)])[0][1] for d in deltas(text, 2)]
    assert "".join(o.new_text for o in outs) == "卡号" and guard.blocked == "bank_card"
    ends = [i for i, o in enumerate(outs) if o.finish_reason is not None]
    assert len(ends) == 1 and outs[ends[0]].finish_reason == "content_filter"  # once, then usage only
    assert outs[-1].usage.completion_tokens == len(outs)  # the tokens after the block still count
    assert state.error == "content_policy"


def test_tokenized_prompt_placeholders_come_back_in_the_answer() -> None:
    from gateway.protocol import ChatCompletionRequest

    card = gen.card(random.Random(2))
    state = RequestState("r")
    session = build_privacy(PrivacySettings(default={"prompt": {"bank_card": "tokenize"}})).session("t", state)
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": f"记住卡号{card}"}]}
    )
    seen = session.screen(body, None)
    assert seen.messages[0].content == "记住卡号[CARD_1]"
    guard = session.completion(1)
    assert guard is not None
    answer = "好的，卡号[CARD_1]已记住"
    for step in range(1, len(answer) + 1):
        g = session.completion(1)
        assert g is not None
        out = "".join(g.apply([(0, d)])[0][1].new_text for d in deltas(answer, step))
        assert out == f"好的，卡号{card}已记住"
        assert g.audit_text() == answer  # the trail keeps the placeholder, not the number
