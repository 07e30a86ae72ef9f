"""gateway.completion._until_disconnect: a non-streamed request watches for its client only once it runs long."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.completion import _until_disconnect


class FakeRequest:
    """`receive()` as Starlette's after the body: blocks until the client leaves (`leave()`), then says so."""

    def __init__(self) -> None:
        self.calls = 0
        self._gone = asyncio.Event()

    def leave(self) -> None:
        self._gone.set()

    async def receive(self) -> dict[str, Any]:
        self.calls += 1
        await self._gone.wait()
        return {"type": "http.disconnect"}


async def test_a_quick_answer_never_starts_the_watcher() -> None:
    request = FakeRequest()
    done = await _until_disconnect(request, asyncio.sleep(0.01), watch_after_s=0.5)  # type: ignore[arg-type]
    assert done is True and request.calls == 0
    await asyncio.sleep(0.6)  # the timer was cancelled: nothing starts watching later either
    assert request.calls == 0


async def test_a_client_that_leaves_a_long_answer_cancels_it() -> None:
    request = FakeRequest()
    cancelled = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    asyncio.get_running_loop().call_later(0.1, request.leave)
    done = await asyncio.wait_for(_until_disconnect(request, work(), watch_after_s=0.05), 10)  # type: ignore[arg-type]
    assert done is False and request.calls == 1 and cancelled.is_set()
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # the cancel was handled


async def test_a_client_gone_before_the_watch_starts_is_noticed_when_it_does() -> None:
    request = FakeRequest()
    request.leave()
    done = await asyncio.wait_for(
        _until_disconnect(request, asyncio.sleep(30), watch_after_s=0.05),  # type: ignore[arg-type]
        10,
    )
    assert done is False and request.calls == 1
