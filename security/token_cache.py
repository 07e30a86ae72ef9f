"""Tokens that verified, remembered by their exact text until they expire.

WHY: a client sends the same bearer token with every request, and checking its signature again (EdDSA or RSA,
~0.1-0.4 ms) was one of the largest costs of a short request. A token's text includes its signature, so a
token that differs in any byte is a different key here and is verified in full. An entry is only used while
the key that verified it is still published (a rotated-out key ends its tokens at once) and while `exp` / `nbf`
still admit it, with the same leeway PyJWT applies.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from security.principal import Principal

DEFAULT_MAX_ENTRIES = 4096


@dataclass(frozen=True)
class _Entry:
    principal: Principal
    exp: float
    nbf: float | None
    key: object  # the key object that verified it: compared by identity with the current key set
    header: tuple[str, str | None]  # its (alg, kid): a repeated token skips parsing its header again


class VerifiedTokens:
    """A bounded LRU map token -> Principal; thread-safe (verify_sync runs on worker threads)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, clock: Callable[[], float] = time.time) -> None:
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, token: str, key: object, leeway_s: float) -> Principal | None:
        """The cached principal, if `token` verified with this very `key` and is still within exp / nbf."""
        if self._max <= 0:
            return None
        with self._lock:
            entry = self._entries.get(token)
            if entry is None:
                return None
            now = self._clock()
            # PyJWT: expired when exp <= now - leeway; immature when nbf > now + leeway
            if (
                entry.key is not key
                or entry.exp <= now - leeway_s
                or (entry.nbf is not None and entry.nbf > now + leeway_s)
            ):
                del self._entries[token]
                return None
            self._entries.move_to_end(token)
            return entry.principal

    def header(self, token: str) -> tuple[str, str | None] | None:
        """The (alg, kid) of a token that verified before (the exact text, so the same header); `get` still
        decides whether the token is still good."""
        entry = self._entries.get(token)  # one dict read: atomic under the GIL, no lock needed
        return None if entry is None else entry.header

    def put(
        self,
        token: str,
        key: object,
        principal: Principal,
        claims: dict[str, object],
        header: tuple[str, str | None],
    ) -> None:
        exp, nbf = claims.get("exp"), claims.get("nbf")
        if self._max <= 0 or not _number(exp) or not (nbf is None or _number(nbf)):
            return
        with self._lock:
            self._entries[token] = _Entry(principal, float(exp), None if nbf is None else float(nbf), key, header)  # type: ignore[arg-type]
            self._entries.move_to_end(token)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
