"""A recorder on the engine seam: what an engine itself produced for each request id.

The usage an API reports and the ledger row both come from the gateway's metering (the same
variable), so comparing the two cannot catch a miscount. This reads the engine instead: the token
ids of every output `Engine.stream` yields (`complete()` reads `stream()` too), and, for the hf
engine, the prompt ids it hands its batching manager (`HFEngine.submit`). Installed on the
session's engine by tests/conftest.py; `EngineIds.on(engine)` finds it (or installs it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from engines.base import Engine, EngineOutput, EngineRequest


@dataclass
class Produced:
    """One request as the engine produced it."""

    prompt: int | None = None  # ids prefilled (hf: handed to the batching manager)
    ids: list[int] = field(default_factory=list)  # every completion id the engine yielded
    text: str = ""  # the text it yielded with them
    finish: str | None = None


class EngineIds:
    def __init__(self) -> None:
        self.requests: dict[str, Produced] = {}

    @classmethod
    def on(cls, engine: Engine) -> "EngineIds":
        tap = engine.__dict__.get("_test_engine_ids")
        if tap is None:
            tap = cls()
            tap._install(engine)
            engine.__dict__["_test_engine_ids"] = tap
        return tap  # type: ignore[no-any-return]

    def _install(self, engine: Engine) -> None:
        stream = engine.stream

        async def tapped(request: EngineRequest) -> AsyncIterator[EngineOutput]:
            produced = self.requests.setdefault(request.request_id, Produced())
            async with aclosing(stream(request)) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    for part in [*(out.before or ()), out]:
                        produced.ids.extend(part.token_ids)
                        produced.text += part.text
                    if out.finished:
                        produced.finish = out.finish_reason
                    yield out

        engine.stream = tapped  # type: ignore[method-assign]
        submit: Callable[..., None] | None = getattr(engine, "submit", None)
        if submit is not None:
            def tapped_submit(rid: str, prompt_ids: list[int], *args: Any, **kwargs: Any) -> None:
                self.requests.setdefault(rid, Produced()).prompt = len(prompt_ids)
                submit(rid, prompt_ids, *args, **kwargs)

            engine.submit = tapped_submit  # type: ignore[attr-defined]

    async def finished(self, request_id: str, timeout: float = 10.0) -> Produced:
        """The request's record once the engine has yielded its final output."""
        deadline = time.monotonic() + timeout
        while (produced := self.requests.get(request_id)) is None or produced.finish is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine yielded no final output for {request_id} within {timeout}s ({produced})")
            await asyncio.sleep(0.02)
        return produced

    async def counts(self, request_id: str, timeout: float = 10.0) -> tuple[int | None, int]:
        """(prompt ids prefilled, completion ids yielded) for a finished request. With n > 1 the hf
        engine prefills each choice as its own request (`<id>#<i>`): the prompt is the first one's."""
        produced = await self.finished(request_id, timeout)
        first_choice = self.requests.get(f"{request_id}#0")
        prompt = produced.prompt if produced.prompt is not None or first_choice is None else first_choice.prompt
        return prompt, len(produced.ids)


class EmbeddedIds:
    """The token ids an embedding model ran its forward pass on, one list per input, in order (its own
    [CLS]/[SEP] aside): read off `EmbeddingModel._forward`, below the gateway's counting."""

    def __init__(self) -> None:
        self.inputs: list[list[int]] = []

    @classmethod
    def on(cls, model: Any) -> "EmbeddedIds":
        tap = model.__dict__.get("_test_embedded_ids")
        if tap is None:
            tap = cls()
            forward = model._forward

            def tapped(inputs: list[list[int]]) -> Any:
                tap.inputs.extend(list(ids) for ids in inputs)
                return forward(inputs)

            model._forward = tapped
            model.__dict__["_test_embedded_ids"] = tap
        return tap  # type: ignore[no-any-return]

    def since(self, mark: int) -> int:
        """Ids embedded after `mark` (a len(inputs) taken before the request)."""
        return sum(len(ids) for ids in self.inputs[mark:])
