"""Turning a growing list of token ids into text deltas, and cutting text at stop strings."""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Emits only text that is final: a trailing partial UTF-8 sequence is held back.

    Each step decodes a short window that starts a few tokens back, so spacing that depends on
    the previous token comes out right and the cost per token stays constant.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is left at the end, partial characters included."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Finds the first stop string in streamed text; holds back text that may begin one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string found (the earliest in the text)

    def push(self, delta: str) -> str:
        """Returns the text safe to emit. After a stop is found, `stopped` is true."""
        if not self._stops:
            return delta
        if self.stopped:
            return ""
        buf = self._held + delta
        found = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
