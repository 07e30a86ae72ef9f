"""Blocking work for a request: on the event loop when its input is small, on a worker thread when it is not.

WHY: a thread hop costs the event loop ~50 µs of its own CPU per call (a future, a wake-up, the GIL handed over
and back) and gains nothing for pure-Python work, which holds the GIL on the worker too. Parsing a short body,
rendering a short chat template or scanning a short prompt costs less than the hop; a large input would stall
every other stream for milliseconds, so it still goes to a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

INLINE_BYTES = 16_384  # inputs up to this size (bytes of the request body, or characters) stay on the loop

P = ParamSpec("P")
T = TypeVar("T")


async def run(size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs), inline when `size` <= INLINE_BYTES, else on a worker thread."""
    if size <= INLINE_BYTES:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)
