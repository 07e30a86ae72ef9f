"""IncrementalDetokenizer: generated token ids → safe text deltas, with stop strings applied."""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the output, so its first token's leading space survives


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text deltas that never split a character or leak a stop string.

    `add()` returns (delta, matched stop string or None); after a match, don't call it again. `flush()` returns
    the withheld text when the request ends for another reason. `text` is everything emitted so far.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._emitted: list[str] = []  # joined only when `text` is read: appending stays O(1) per token
        self.finished = False
        # NOTE: _ids is a sliding window: _ids[:_read] decodes to _read_text and has been released; the window
        # restarts at the old read point whenever text is released, so each decode covers a few tokens only.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._read = len(self._ids)
        self._read_text = self._decode(self._ids)
        self._pending = ""  # decoded but withheld: it could be the start of a stop string

    def add(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        assert not self.finished, "add() after a stop string or flush()"
        self._ids.extend(token_ids)
        window_text = self._decode(self._ids)
        # a trailing U+FFFD is a character whose remaining bytes are still to come
        if len(window_text) <= len(self._read_text) or window_text.endswith("\ufffd"):
            return "", None
        new_text = window_text[len(self._read_text) :]
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._read_text = self._decode(self._ids)
        return self._release(new_text, final=False)

    @property
    def text(self) -> str:
        return "".join(self._emitted)

    def flush(self) -> str:
        if self.finished:
            return ""
        window_text = self._decode(self._ids)
        delta, _ = self._release(window_text[len(self._read_text) :], final=True)
        self.finished = True
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self, new_text: str, final: bool) -> tuple[str, str | None]:
        if not self.stop:
            self._emitted.append(new_text)
            return new_text, None
        pending = self._pending + new_text
        match = _first_stop(pending, self.stop)
        if match is not None:
            start, stop = match
            delta = pending[: start + len(stop)] if self.include_stop_str_in_output else pending[:start]
            self._pending = ""
            self.finished = True
            self._emitted.append(delta)
            return delta, stop
        keep = 0 if final else _partial_stop_len(pending, self.stop)
        delta, self._pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self._emitted.append(delta)
        return delta, None


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The stop string that completes first in `text` (the longest of those ending at one place), and its start."""
    best: tuple[int, int, str] | None = None  # (end, -len, stop)
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            key = (start + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
    return None if best is None else (best[0] + best[1], best[2])


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
