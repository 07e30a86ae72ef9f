"""RequestState: what the middleware, admission, routes, metrics and the audit hook share about one call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestState:
    """Set once per request by RequestContext in `scope["request_state"]`; each layer fills in its own fields.

    Replaces the old `scope["audit"]` dict: a misspelt field is an AttributeError, not a silent None."""

    request_id: str
    start: float = field(default_factory=time.time)  # wall clock, for the event's @timestamp
    status: int = 500  # until a response starts
    duration_s: float = 0.0
    # who (Auth)
    user: str | None = None
    tenant: str | None = None
    auth_failure: str | None = None
    # what (routes)
    model: str | None = None
    stream: bool | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int = 0
    cached_tokens: int | None = None
    finish_reason: str | None = None
    ttft_ms: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_text: str | None = None  # only for the audit content policy; never logged
    response_text: str | None = None
    # structured outputs and tool calling (names only: arguments are content)
    constrained: bool | None = None  # the output had to match a schema or grammar
    tool_calls: list[str] | None = None  # the functions the model called; None: no tools in the request
    # decisions
    ratelimit: str | None = None
    # the privacy policies that fired (gateway.privacy): (direction, policy, action) → count; never the text
    policy_hits: dict[tuple[str, str, str], int] = field(default_factory=dict)
    error: str | None = None
    settled_by_stream: bool = False
    # audit (gateway.audit_hook): a streamed response gets an opening and a closing record
    streaming: bool = False  # the response is text/event-stream; set before on_response_start
    audit_record: str | None = None  # "complete" | "open": what on_response_start made durable
