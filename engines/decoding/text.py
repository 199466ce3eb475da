"""Turning a growing list of token ids into text deltas, and cutting text at stop strings; one
request's ids as engine outputs (`TokenProgress`, what an in-process backend streams)."""

from __future__ import annotations

from typing import Any

from engines.base import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, EngineOutput, EngineRequest

REPLACEMENT = "\ufffd"


def fast_decoder(tokenizer: Any) -> Any | None:
    """The `tokenizers` library's Tokenizer behind a transformers fast tokenizer, when decoding through
    it gives the same text (no clean-up pass after it): a tenth of transformers' cost per call, and
    None: decode through `tokenizer`."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


class IncrementalDetokenizer:
    """Emits only text that is final: a trailing partial UTF-8 sequence is held back.

    Each step decodes a short window that starts a few tokens back, so spacing that depends on
    the previous token comes out right and the cost per token stays constant.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._fast = fast_decoder(tokenizer)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=True)  # type: ignore[no-any-return]
        return self._tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[no-any-return]

    def _take(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if final:
            self._prefix_offset = self._read_offset = len(self._ids)
            return full[len(prefix) :]
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def push(self, new_ids: list[int]) -> str:
        """The new text that is final."""
        self._ids.extend(new_ids)
        return self._take(final=False)

    def flush(self) -> str:
        """Whatever is left at the end, partial characters included."""
        return self._take(final=True)


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


class TokenProgress:
    """One request's generated token ids, as they arrive, as engine outputs: text that is final
    (incremental detokenization), cut at the first stop string, and the finish reason at the end."""

    def __init__(self, tokenizer: Any, request: EngineRequest, prompt_tokens: int, eos_ids: set[int]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        # None without stop strings (most requests): then no stop matcher is called per output.
        self._stops = StopMatcher(request.sampling.stop) if any(request.sampling.stop) else None
        self._max_tokens = request.max_tokens
        self._prompt_tokens = prompt_tokens
        self._eos_ids = eos_ids
        self._last_id: int | None = None
        self.seen = 0

    def _output(self, text: str, ids: list[int], reason: str | None, queue_ms: float | None, error: str | None = None) -> EngineOutput:
        return EngineOutput(text, ids, reason, self._prompt_tokens, self.seen, error=error, queue_ms=queue_ms,
                            stop_sequence=self._stops.matched if self._stops is not None else None)

    def cancelled(self, queue_ms: float | None) -> EngineOutput:
        return self._output("", [], FINISH_CANCELLED, queue_ms)

    def advance(self, new_ids: list[int], engine_done: bool, error: str | None, queue_ms: float | None) -> EngineOutput | None:
        """The output for these new ids (None: nothing to say yet). A finished output whose
        `engine_done` was false ended at a stop string: the engine request is still running."""
        text = self._detok.push(new_ids)
        if engine_done and not error:
            text += self._detok.flush()
        self.seen += len(new_ids)
        if new_ids:
            self._last_id = new_ids[-1]
        stops = self._stops
        if stops is not None:
            text = stops.push(text)
            if stops.stopped:
                return self._output(text, new_ids, FINISH_STOP, queue_ms)
        if not engine_done:
            return self._output(text, new_ids, None, queue_ms) if text or new_ids else None
        if error:
            return self._output(text, new_ids, FINISH_ERROR, queue_ms, error=error)
        if stops is not None:
            text += stops.flush()
        reason = FINISH_STOP if self.seen and self._last_id in self._eos_ids else FINISH_LENGTH
        if self.seen < self._max_tokens and reason == FINISH_LENGTH:
            reason = FINISH_STOP
        return self._output(text, new_ids, reason, queue_ms)
