"""FallbackEngine: the first engine that can take a request gets it; a failure before the first
output moves it on (re-encoded for that engine's tokenizer), never after."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engines.base import FINISH_CANCELLED, FINISH_ERROR, FINISH_STOP, Engine, EngineError, EngineOutput, EngineOverloadedError, EngineRequest, SamplingParams
from engines.wrappers.fallback import FallbackEngine, PromptIds, SharedLifecycle
from engines.backends.hf import HFEngine
from engines.backends.openai_pool import OpenAIPoolEngine
from engines.backends.trtllm import TRTLLMEngine
from tests.engines.conftest import closed_port
from tests.fakes import trtllm as double

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class ScriptedEngine(Engine):
    """An engine that yields what the test scripts, and records what it was asked."""

    def __init__(self, model_id: str, outputs: list[EngineOutput] | Exception, *, context_length: int = 1000) -> None:
        self.model_id = model_id
        self.context_length = context_length
        self.outputs = outputs
        self.requests: list[EngineRequest] = []
        self.cancelled: list[str] = []
        self.starts = 0
        self.up = True
        self.go_on = asyncio.Event()  # not `release`: that is Engine.release()
        self.go_on.set()

    @property
    def ready(self) -> bool:
        return self.up

    async def start(self) -> None:
        self.starts += 1
        await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.up = False

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return [len(m["content"]) for m in messages]

    def encode_text(self, prompt: str) -> list[int]:
        return [len(prompt)]

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.requests.append(request)
        await self.go_on.wait()
        if isinstance(self.outputs, Exception):
            raise self.outputs
        for out in self.outputs:
            if request.request_id in self.cancelled:
                yield EngineOutput("", [], FINISH_CANCELLED, 1, 0)
                return
            yield out

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def has_capacity(self) -> bool:
        return True

    def requests_in_flight(self) -> int:
        return 0


def ok(text: str = "hi") -> list[EngineOutput]:
    return [EngineOutput(text, [1], None, 1, 1), EngineOutput("", [], FINISH_STOP, 1, 1)]


def chat_request(engine: Engine, rid: str = "r1", max_tokens: int = 50) -> EngineRequest:
    body = {"model": "m", "messages": QUESTION}
    return EngineRequest(rid, max_tokens, SamplingParams(temperature=0.0), prompt_token_ids=engine.encode_chat(QUESTION), extra=body)


VIA = {"way": "stream"}


@pytest.fixture(autouse=True, params=["stream", "complete"])
def via(request: pytest.FixtureRequest) -> Any:
    """Every test asks the chain through `stream()` and again through `complete()` (the one-body
    coroutine): the same candidates tried, the same reasons to move on, the same outputs."""
    VIA["way"] = request.param
    yield request.param
    VIA["way"] = "stream"


async def drain(engine: Engine, request: EngineRequest) -> list[EngineOutput]:
    if VIA["way"] == "complete":
        out = await engine.complete(request)
        return [*(out.before or ()), out]
    return [o async for o in engine.stream(request)]


async def test_failure_before_the_first_output_moves_to_the_next_engine() -> None:
    broken = ScriptedEngine("a", EngineError("boom"))
    erroring = ScriptedEngine("b", [EngineOutput("", [], FINISH_ERROR, 1, 0, error="oom")])
    good = ScriptedEngine("c", ok("from c"))
    model = FallbackEngine("m", [broken, erroring, good])
    outs = await drain(model, chat_request(model))
    assert [o.text for o in outs] == ["from c", ""]
    assert [len(e.requests) for e in (broken, erroring, good)] == [1, 1, 1]


async def test_no_failover_after_the_first_output() -> None:
    first = ScriptedEngine("a", [EngineOutput("partial", [1], None, 1, 1), EngineOutput("", [], FINISH_ERROR, 1, 1, error="lost")])
    second = ScriptedEngine("b", ok())
    model = FallbackEngine("m", [first, second])
    outs = await drain(model, chat_request(model))
    assert [(o.text, o.finish_reason) for o in outs] == [("partial", None), ("", FINISH_ERROR)]
    assert second.requests == []


async def test_engines_that_are_down_full_or_too_small_are_skipped() -> None:
    down = ScriptedEngine("down", ok("down"))
    down.up = False
    small = ScriptedEngine("small", ok("small"), context_length=1)
    full = ScriptedEngine("full", ok("full"))
    full.has_capacity = lambda: False  # type: ignore[method-assign]
    good = ScriptedEngine("good", ok("good"))
    model = FallbackEngine("m", [down, full, small, good])
    request = chat_request(model)
    assert isinstance(request.prompt_token_ids, PromptIds) and request.prompt_token_ids.encoder is full  # first ready
    outs = await drain(model, request)
    assert outs[0].text == "good"
    assert (down.requests, full.requests, small.requests) == ([], [], [])
    assert model.has_capacity() and model.ready


async def test_when_no_engine_can_take_it_the_answer_is_overloaded() -> None:
    full = ScriptedEngine("a", EngineOverloadedError("full"))
    model = FallbackEngine("m", [full, ScriptedEngine("b", EngineOverloadedError("full too"))])
    with pytest.raises(EngineOverloadedError):
        await drain(model, chat_request(model))
    broken = FallbackEngine("m", [ScriptedEngine("a", EngineOverloadedError("full")), ScriptedEngine("b", EngineError("broken"))])
    with pytest.raises(EngineError) as info:
        await drain(broken, chat_request(broken))
    assert not isinstance(info.value, EngineOverloadedError) and "broken" in str(info.value)


async def test_cancel_reaches_the_engine_serving_the_request() -> None:
    slow = ScriptedEngine("a", ok() * 1)
    slow.go_on.clear()
    model = FallbackEngine("m", [slow])
    task = asyncio.create_task(drain(model, chat_request(model, "r9")))
    while model._routes.get("r9") is not slow:
        await asyncio.sleep(0.005)
    model.cancel("r9")
    slow.go_on.set()
    outs = await task
    assert slow.cancelled == ["r9"] and outs[-1].finish_reason == FINISH_CANCELLED
    model.cancel("r9")  # after the end: nothing to do, nothing remembered
    assert model._cancelled == set() and model._routes == {}


async def test_a_shared_engine_starts_and_stops_once() -> None:
    shared = ScriptedEngine("shared", ok())
    lifecycle = SharedLifecycle()
    a = FallbackEngine("a", [ScriptedEngine("a", ok()), shared], lifecycle=lifecycle)
    b = FallbackEngine("b", [shared], lifecycle=lifecycle)
    await asyncio.gather(a.start(), b.start(), b.start())
    assert shared.starts == 1
    await a.stop()
    await b.stop()
    assert not shared.up


async def test_a_trtllm_engine_falls_back_to_hf_with_the_prompt_re_encoded(engine: HFEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    api = double.install(monkeypatch)
    trt = TRTLLMEngine(model_id="llama", model_path="/models/llama", context_length=4096, api=api)
    await trt.start()
    model = FallbackEngine("llama", [trt, engine])
    request = chat_request(model, max_tokens=12)
    assert request.prompt_token_ids.encoder is trt  # type: ignore[union-attr]
    trt._llm.shut_down = True  # the in-process engine now refuses every request
    outs = await drain(model, request)
    hf_prompt = engine.encode_chat(QUESTION)
    assert outs[-1].prompt_tokens == len(hf_prompt) != len(request.prompt_token_ids or [])
    assert "Paris" in "".join(o.text for o in outs)
    assert not any(o.estimated for o in outs)
    await trt.stop()


async def test_an_unreachable_pool_falls_back_to_hf(engine: HFEngine) -> None:
    pool = OpenAIPoolEngine(model_id="pool", replicas=[f"http://127.0.0.1:{closed_port()}/v1"], context_length=8192, health_path=None, retries=0)
    await pool.start()
    try:
        model = FallbackEngine("pool", [pool, engine])
        assert not model.passthrough  # hf cannot honour tools: the gateway checks fields for this model
        outs = await drain(model, chat_request(model, max_tokens=12))
        assert "Paris" in "".join(o.text for o in outs)
        assert outs[-1].prompt_tokens == len(engine.encode_chat(QUESTION))
        assert pool.pool.snapshot()[0]["failures"] == 1
    finally:
        await pool.stop()


class PlacedEngine(ScriptedEngine):
    """A ScriptedEngine that keeps the places admit() takes, as a scheduler does."""

    def __init__(self, model_id: str, outputs: list[EngineOutput] | Exception) -> None:
        super().__init__(model_id, outputs)
        self.places: set[str] = set()

    def admit(self, request: EngineRequest) -> None:
        self.places.add(request.request_id)

    def release(self, request_id: str) -> None:
        self.places.discard(request_id)


async def test_the_place_admit_took_is_given_back_when_another_engine_of_the_chain_serves() -> None:
    # The admission gives up its place once the stream has the request (settling releases nothing
    # then), so the chain must give back a place held at an engine that did not serve it.
    failing = PlacedEngine("a", EngineError("boom"))
    serving = PlacedEngine("b", ok("from b"))
    model = FallbackEngine("m", [failing, serving])
    request = chat_request(model)
    model.admit(request)
    assert failing.places == {request.request_id}
    outs = await drain(model, request)
    assert [o.text for o in outs] == ["from b", ""]
    assert failing.places == set()
