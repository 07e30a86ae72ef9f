"""Failed authentications per source IP: GCRA in process, an LRU of bounded size, so a flood costs bounded memory."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class FailedAuthLimiter:
    """`per_minute` failures per source IP with bursts of `burst`; beyond that `failed()` says how long to wait.

    Only failures are charged: a valid token is served whatever its source's record, so one client's flood
    behind a shared NAT cannot lock out its neighbours. At most `max_sources` IPs are tracked; the least
    recently seen is forgotten first (it loses nothing but its own debt)."""

    def __init__(
        self,
        per_minute: int,
        burst: int,
        max_sources: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_minute < 1 or burst < 1 or max_sources < 1:
            raise ValueError("failed-auth limits must be positive")
        self.interval = 60.0 / per_minute
        self.tolerance = self.interval * (burst - 1)  # GCRA: how far the arrival time may run ahead of now
        self.max_sources, self.clock = max_sources, clock
        self._tat: OrderedDict[str, float] = OrderedDict()  # theoretical arrival time per source

    def failed(self, source: str) -> float | None:
        """Charge one failure to `source`; None while within the limit, else the seconds until one is allowed."""
        now = self.clock()
        tat = max(self._tat.get(source, now), now)
        if tat - now > self.tolerance:
            self._tat.move_to_end(source)
            return tat - self.tolerance - now
        self._tat[source] = tat + self.interval
        self._tat.move_to_end(source)
        while len(self._tat) > self.max_sources:
            self._tat.popitem(last=False)
        return None

    def __len__(self) -> int:
        return len(self._tat)
