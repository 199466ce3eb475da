"""Several choices (OpenAI's `n`) on the `hf` engine: n sequences of one request, each a request of
its own in the batching manager (`<id>#<i>`), their outputs merged into the one stream the gateway
relays and meters.

Streamed, each output carries one choice's chunk (`raw_choice` with its `index`; the first chunk of
choices 1..n-1 carries the role, the gateway opened choice 0). Not streamed, the final output carries
every choice (`choices`). Counts: the prompt once, completion tokens summed over the n sequences
(what the engine computed). The request ends when every choice has ended; a cancel ends them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from engines.base import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, EngineOutput, EngineRequest
from engines.decoding.structured import AnswerShape

_END = object()


def choice_ids(request_id: str, n: int) -> list[str]:
    return [f"{request_id}#{i}" for i in range(n)]


class _Choice:
    def __init__(self, index: int, shape: AnswerShape | None) -> None:
        self.index = index
        self.shape = shape
        self.text: list[str] = []
        self.tokens = 0
        self.finish: str | None = None
        self.opened = index == 0
        self.whole: dict[str, Any] | None = None  # a shaped choice's final object (not streamed)


async def merged(
    request: EngineRequest,
    generate: Callable[[EngineRequest], AsyncIterator[EngineOutput]],
    parser: str | None,
) -> AsyncIterator[EngineOutput]:
    """The outputs of `request` (n > 1) from one `generate` stream per choice."""
    body = request.extra or {}
    chat, streamed = "messages" in body, body.get("stream") is True
    choices = [_Choice(i, AnswerShape(parser, streamed) if parser else None) for i in range(request.n)]
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(choice: _Choice, sub: EngineRequest) -> None:
        try:
            async with aclosing(generate(sub)) as outputs:
                async for out in outputs:
                    queue.put_nowait((choice.index, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((choice.index, exc))
        queue.put_nowait((choice.index, _END))

    # A seeded request's choices each get their own seed (the same seed for all would give n equal choices).
    seed = request.sampling.seed
    subs = [dataclasses.replace(request, request_id=rid, n=1, best_of=1,
                                sampling=request.sampling if seed is None else dataclasses.replace(request.sampling, seed=seed + i))
            for i, rid in enumerate(choice_ids(request.request_id, request.n))]
    tasks = [asyncio.get_running_loop().create_task(pump(c, s)) for c, s in zip(choices, subs)]
    prompt_tokens, queue_ms, running = 0, None, len(choices)
    try:
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
                continue
            if isinstance(item, Exception):
                raise item
            choice = choices[index]
            out: EngineOutput = item
            prompt_tokens, choice.tokens = out.prompt_tokens or prompt_tokens, out.completion_tokens
            queue_ms = queue_ms if queue_ms is not None else out.queue_ms
            total = sum(c.tokens for c in choices)
            if out.finish_reason in (FINISH_CANCELLED, FINISH_ERROR):
                yield EngineOutput("", out.token_ids, out.finish_reason, prompt_tokens, total, error=out.error, queue_ms=queue_ms)
                return
            if choice.shape is not None:
                out = choice.shape.shaped(out)
            choice.finish = out.finish_reason or choice.finish
            merged_out = EngineOutput("", out.token_ids, None, prompt_tokens, total, queue_ms=queue_ms)
            if streamed:
                merged_out.raw_choice = _chunk(chat, choice, out)
            elif choice.shape is not None and out.raw_choice is not None:
                choice.whole = out.raw_choice
            else:
                choice.text.append(out.text)
            if all(c.finish is not None for c in choices):
                overall = FINISH_LENGTH if any(c.finish == FINISH_LENGTH for c in choices) else FINISH_STOP
                merged_out.finish_reason = overall
                if not streamed:
                    merged_out.choices = [_whole(chat, c) for c in choices]
                yield merged_out
                return
            if merged_out.raw_choice is not None or merged_out.token_ids:
                yield merged_out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _chunk(chat: bool, choice: _Choice, out: EngineOutput) -> dict[str, Any] | None:
    """One choice's streamed chunk for this output (None: nothing to send)."""
    finish = None if out.finish_reason is None else (out.raw_choice or {}).get("finish_reason", out.finish_reason)
    if not chat:
        return {"index": choice.index, "text": out.text, "logprobs": None, "finish_reason": finish} if out.text or finish else None
    if out.raw_choice is not None:  # a shaped (tools) chunk
        delta = dict(out.raw_choice.get("delta") or {})
    else:
        delta = {"content": out.text} if out.text else {}
    if not delta and finish is None:
        return None
    if not choice.opened:
        choice.opened = True
        delta = {"role": "assistant", **delta}
    return {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": finish}


def _whole(chat: bool, choice: _Choice) -> dict[str, Any]:
    if choice.whole is not None:
        return {**choice.whole, "index": choice.index}
    text = "".join(choice.text)
    if chat:
        return {"index": choice.index, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": choice.finish}
    return {"index": choice.index, "text": text, "logprobs": None, "finish_reason": choice.finish}
