"""The hf engine in a process of its own (engines/hf_process.py), with the real embedded model:
the same outputs as the in-process engine, stop strings and cancels that end the request in the
engine process too, a dead engine process that fails its streams and stops being ready, and a
failed load that says why."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from engines.base import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, EngineError, EngineOutput, EngineRequest, SamplingParams
from engines.hf import HFEngine, drain
from engines.hf_process import HFProcessEngine
from tests.conftest import MODEL, run_coro

PROMPT = [{"role": "user", "content": "Tell me about Paris."}]


def request(engine: HFEngine, max_tokens: int = 12, stop: tuple[str, ...] = ()) -> EngineRequest:
    return EngineRequest(request_id=uuid.uuid4().hex, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0, stop=stop),
                         prompt_token_ids=engine.encode_chat(PROMPT))


async def collect(engine: HFEngine, req: EngineRequest) -> list[EngineOutput]:
    return [out async for out in engine.stream(req)]


class EngineLoop:
    """A process engine started and driven on one event loop in a thread (its streams live on it)."""

    def __init__(self, **params: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = HFProcessEngine(model_id=MODEL, max_batch_size=4, max_queue=4, **params)
        import threading

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 180.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.engine.stop(), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(15)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def separate() -> Iterator[EngineLoop]:
    box = EngineLoop()
    box.run(box.engine.start())
    try:
        yield box
    finally:
        box.close()


def test_the_model_runs_in_another_process_and_streams_what_the_in_process_engine_streams(engine: HFEngine, separate: EngineLoop) -> None:
    proc = separate.engine
    assert proc.pid is not None and proc.pid != os.getpid()
    assert (proc.context_length, proc.vocab_size) == (engine.context_length, engine.vocab_size)
    apart = separate.run(collect(proc, request(proc)))
    inside = run_coro(collect(engine, request(engine)))
    assert "".join(o.text for o in apart) == "".join(o.text for o in inside)
    assert (apart[-1].finish_reason, apart[-1].prompt_tokens, apart[-1].completion_tokens) == (
        inside[-1].finish_reason, inside[-1].prompt_tokens, inside[-1].completion_tokens)
    assert apart[-1].finish_reason == FINISH_LENGTH and apart[-1].completion_tokens == 12
    # Whether or not outputs were coalesced, every token id arrived once.
    assert sum(len(o.token_ids) for o in apart) == apart[-1].completion_tokens
    assert apart[-1].queue_ms is not None


def test_a_stop_string_ends_the_stream_and_the_request_in_the_engine_process(separate: EngineLoop) -> None:
    proc = separate.engine
    full = "".join(o.text for o in separate.run(collect(proc, request(proc, max_tokens=20))))
    word = full.split()[1]  # a word the greedy answer holds
    outs = separate.run(collect(proc, request(proc, max_tokens=20, stop=(word,))))
    assert outs[-1].finish_reason == FINISH_STOP
    assert word not in "".join(o.text for o in outs)
    assert proc.requests_in_flight() == 0
    assert separate.run(proc.held_in_engine()) == 0  # the engine process dropped it too
    # The engine process cancelled its request: every slot is free for a full batch at once.
    async def full_batch() -> list[list[EngineOutput]]:
        return list(await asyncio.gather(*(collect(proc, request(proc, max_tokens=4)) for _ in range(4))))

    batch = separate.run(full_batch())
    assert [b[-1].completion_tokens for b in batch] == [4, 4, 4, 4]


def test_cancel_ends_the_stream_with_cancelled(separate: EngineLoop) -> None:
    proc = separate.engine

    async def cancel_after_first() -> list[EngineOutput]:
        req = request(proc, max_tokens=200)
        outs = []
        async for out in proc.stream(req):
            outs.append(out)
            if len(outs) == 1:
                proc.cancel(req.request_id)
        return outs

    outs = separate.run(cancel_after_first(), timeout=60)
    assert outs[-1].finish_reason == FINISH_CANCELLED
    assert outs[-1].completion_tokens < 200
    assert proc.requests_in_flight() == 0
    assert separate.run(proc.held_in_engine()) == 0


def test_drain_takes_everything_already_queued() -> None:
    async def main() -> list[list[int]]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(3):
            queue.put_nowait(i)
        first = await drain(queue)
        queue.put_nowait(7)
        return [first, await drain(queue)]

    assert asyncio.run(main()) == [[0, 1, 2], [7]]


def test_a_dead_engine_process_fails_its_streams_and_is_no_longer_ready(caplog: pytest.LogCaptureFixture) -> None:
    box = EngineLoop()
    try:
        proc = box.engine
        box.run(proc.start())
        assert proc.ready

        async def killed_mid_stream() -> list[EngineOutput]:
            outs = []
            async for out in proc.stream(request(proc, max_tokens=500)):
                outs.append(out)
                if len(outs) == 1:
                    os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
            return outs

        with caplog.at_level(logging.ERROR, logger="tollgate.engines.hf_process"):
            outs = box.run(killed_mid_stream(), timeout=60)
        assert outs[-1].finish_reason == FINISH_ERROR
        assert "engine process exited" in (outs[-1].error or "")
        assert not proc.ready
        assert any("engine process exited" in r.getMessage() for r in caplog.records)
        with pytest.raises(EngineError, match="engine process exited"):
            box.run(collect(proc, request(proc)))
    finally:
        box.close()


def test_a_model_that_cannot_load_is_an_engine_error_that_says_why() -> None:
    box = EngineLoop(model_path="/nonexistent/model")
    try:
        with pytest.raises(EngineError, match="neither a checkpoint directory nor a .gguf file"):
            box.run(box.engine.start())
        assert not box.engine.ready
        assert box.engine._process.poll() is not None  # the engine process is gone
    finally:
        box.close()
