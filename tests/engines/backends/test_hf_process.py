"""The hf engine in a process of its own (engines/backends/hf_process.py), with the real embedded model:
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
from engines.backends.hf import HFEngine, drain
from engines.backends.hf_process import HFProcessEngine
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


# The burst gathering in the engine process (_StepRelay): the gathering logic against a stand-in for
# the batching manager that records what it is handed and when (the real model runs in the tests above,
# whose first request after start goes through the gathering too).
class Submissions:
    def __init__(self, loop: asyncio.AbstractEventLoop, expect: int) -> None:
        self.loop = loop
        self.expect = expect
        self.calls: list[tuple[str, float, int]] = []  # (rid, loop time, how many release rounds so far)
        self.cancelled: list[str] = []
        self.done = loop.create_future()
        self.rounds = 0

    def submit(self, rid: str, prompt_ids: list[int], max_tokens: int, sampling: Any, handler: Any, grammar: Any = None) -> None:
        self.calls.append((rid, self.loop.time(), self.rounds))
        if len(self.calls) >= self.expect and not self.done.done():
            self.done.set_result(None)

    def _cancel(self, rid: str) -> None:
        self.cancelled.append(rid)


def relay_with(gather_s: float, expect: int, **step: int) -> tuple[Any, Submissions]:
    from engines.backends.hf_process import _StepRelay

    loop = asyncio.get_running_loop()
    engine = Submissions(loop, expect)
    relay = _StepRelay(None, loop, engine, gather_s, **step)  # type: ignore[arg-type]
    release = relay._release

    def counted_release() -> None:
        engine.rounds += 1
        release()

    relay._release = counted_release  # type: ignore[method-assign]
    return relay, engine


def add(relay: Any, rid: str) -> None:
    relay.add(rid, [1, 2, 3], 4, 0.0, 1.0, None)


def test_a_burst_after_idle_is_submitted_together_once_it_stops_coming() -> None:
    async def scenario() -> None:
        relay, engine = relay_with(gather_s=5.0, expect=3)  # a long deadline: the quiet gap ends it
        for rid in ("a", "b", "c"):
            add(relay, rid)
        assert engine.calls == []  # held, not handed to the manager one by one
        await asyncio.wait_for(engine.done, 5.0)
        assert [c[0] for c in engine.calls] == ["a", "b", "c"]  # in arrival order
        assert {c[2] for c in engine.calls} == {1}  # one release round: the first step sees all three
        add(relay, "d")  # the engine is busy now: no waiting behind a running step
        assert [c[0] for c in engine.calls][-1] == "d"

    run_coro(scenario())


def test_a_burst_that_keeps_coming_is_released_by_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    import engines.backends.hf_process as hf_process

    monkeypatch.setattr(hf_process, "GATHER_QUIET_S", 60.0)  # the quiet gap never ends it here: only the deadline can

    async def scenario() -> None:
        relay, engine = relay_with(gather_s=0.05, expect=1)
        loop = asyncio.get_running_loop()
        added = 0
        stopped = loop.create_future()

        def next_add() -> None:  # a request every millisecond, up to 2,000 of them
            nonlocal added
            add(relay, f"r{added}")
            added += 1
            if added < 2000 and not engine.calls:
                loop.call_later(0.001, next_add)
            else:
                stopped.set_result(added)

        started = loop.time()
        next_add()
        made = await asyncio.wait_for(stopped, 30.0)
        assert made < 2000, "the gathering never ended while requests kept coming"
        assert engine.calls[0][1] - started >= 0.05  # not before the deadline
        assert {c[2] for c in engine.calls} == {1} and len(engine.calls) == made  # every held one, in one release round

    run_coro(scenario())


def test_a_burst_that_fills_the_first_step_is_handed_over_at_once() -> None:
    async def scenario() -> None:
        # a long deadline and requests with no quiet gap between them: only a full step can end it
        relay, engine = relay_with(gather_s=5.0, expect=2, step_tokens=7)
        add(relay, "a")
        add(relay, "b")
        assert engine.calls == []  # 6 prompt tokens held: the step (7) is not full yet
        relay.cancel("b")  # a cancelled one no longer counts towards the step
        add(relay, "c")
        assert engine.calls == []
        add(relay, "d")  # a, c, d: 9 tokens >= 7, handed over in this call, without waiting
        assert [c[0] for c in engine.calls] == ["a", "c", "d"] and {c[2] for c in engine.calls} == {1}
        add(relay, "e")  # the engine is busy now: at once
        assert [c[0] for c in engine.calls][-1] == "e"

        relay, engine = relay_with(gather_s=5.0, expect=2, step_requests=2)  # the same for requests per step
        add(relay, "x")
        assert engine.calls == []
        add(relay, "y")
        assert [c[0] for c in engine.calls] == ["x", "y"]

    run_coro(scenario())


def test_a_request_cancelled_while_held_never_reaches_the_engine() -> None:
    async def scenario() -> None:
        relay, engine = relay_with(gather_s=5.0, expect=1)
        add(relay, "gone")
        add(relay, "kept")
        relay.cancel("gone")
        assert engine.cancelled == []  # the manager never had it: nothing to cancel there
        await asyncio.wait_for(engine.done, 5.0)
        assert [c[0] for c in engine.calls] == ["kept"]

    run_coro(scenario())


def test_gathering_off_submits_at_once() -> None:
    async def scenario() -> None:
        relay, engine = relay_with(gather_s=0.0, expect=1)
        add(relay, "now")
        assert [c[0] for c in engine.calls] == ["now"]

    run_coro(scenario())


def test_gather_ms_is_a_setting_and_a_negative_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.config import load_settings

    monkeypatch.setenv("TOLLGATE_ENGINE_GATHER_MS", "5")
    assert load_settings().engines.gather_ms == 5
    monkeypatch.setenv("TOLLGATE_ENGINE_GATHER_MS", "-1")
    with pytest.raises(SystemExit, match="TOLLGATE_ENGINE_GATHER_MS must be at least 0, got -1"):
        load_settings()
    with pytest.raises(ValueError, match="gather_ms must be 0 or more"):
        HFProcessEngine(model_id=MODEL, gather_ms=-1)
