"""A fast, deterministic engine behind the real gateway, for tests about HTTP and metering rather
than generation (schemathesis, the security scan): one token per character of the prompt, and
up to `max_reply` generated tokens, with no model behind them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from engines.base import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, Engine, EngineOutput, EngineRequest

WORDS = ["Yes", ",", " it", " is", "."]


class FakeEngine(Engine):
    def __init__(self, model_id: str, *, context_length: int = 4096, max_reply: int = len(WORDS), delay: float = 0.0) -> None:
        self.model_id = model_id
        self.context_length = context_length
        self.vocab_size = 256
        self.max_reply = max_reply
        self.delay = delay
        self._cancelled: set[str] = set()
        self._running: set[str] = set()

    @property
    def ready(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)
        return [ord(c) % 256 for c in text] or [0]

    def encode_text(self, prompt: str) -> list[int]:
        return [ord(c) % 256 for c in prompt]

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        prompt = len(request.prompt_token_ids or [])
        n = min(request.max_tokens, self.max_reply)
        self._running.add(request.request_id)
        try:
            for i in range(n):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if request.request_id in self._cancelled:
                    yield EngineOutput("", [], FINISH_CANCELLED, prompt, i)
                    return
                word = WORDS[i % len(WORDS)]
                yield EngineOutput(word, [i], None, prompt, i + 1)
            yield EngineOutput("", [], FINISH_LENGTH if n == request.max_tokens else FINISH_STOP, prompt, n)
        finally:
            self._running.discard(request.request_id)
            self._cancelled.discard(request.request_id)

    def cancel(self, request_id: str) -> None:
        if request_id in self._running:
            self._cancelled.add(request_id)

    def has_capacity(self) -> bool:
        return True

    def requests_in_flight(self) -> int:
        return len(self._running)
