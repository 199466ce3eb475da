"""The embedded engine serves event loops in several threads at once (two gateways on one
engine, as the suite runs them): each request's tokens arrive on the loop that asked."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

from engines.base import EngineRequest, SamplingParams
from engines.backends.hf import HFEngine


def test_two_event_loops_stream_from_one_engine_at_once(engine: HFEngine) -> None:
    prompt = engine.encode_chat([{"role": "user", "content": "Count to ten."}])
    started = threading.Barrier(2)
    results: dict[str, Any] = {}

    async def streams(name: str) -> list[int]:
        async def one() -> int:
            request = EngineRequest(request_id=f"{name}-{uuid.uuid4().hex[:8]}", max_tokens=12,
                                    sampling=SamplingParams(temperature=0.0), prompt_token_ids=list(prompt))
            last = None
            async for out in engine.stream(request):
                last = out
            assert last is not None and last.finished
            return last.completion_tokens

        started.wait(10)  # both loops' requests share the engine's batches
        return await asyncio.wait_for(asyncio.gather(*[one() for _ in range(4)]), 60)

    def run(name: str) -> None:
        try:
            results[name] = asyncio.run(streams(name))
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for name in ("a", "b"):
        assert isinstance(results.get(name), list), f"loop {name}: {results.get(name)!r}"
        assert all(0 < n <= 12 for n in results[name])


def test_a_result_delivered_from_another_loop_wakes_the_requests_loop() -> None:
    """transformers runs a batch's result handlers on one loop (the last one it looked up); the
    handler Tollgate registers hands each result to the loop its request waits on, at once."""
    from engines.backends.hf import _deliver_on

    async def owner() -> float:
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        handler = _deliver_on(loop, outputs)

        def foreign() -> None:
            async def deliver() -> None:
                await asyncio.sleep(0.2)
                handler("token")  # called on this thread's own running loop, as deliver_batch does

            asyncio.run(deliver())

        threading.Thread(target=foreign).start()
        began = loop.time()
        assert await asyncio.wait_for(outputs.get(), 5) == "token"
        return loop.time() - began

    assert asyncio.run(owner()) < 2.0  # a put from the foreign thread would wait for the 5 s timer
