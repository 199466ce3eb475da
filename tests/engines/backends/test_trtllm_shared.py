"""The `trtllm` backend through its engine host (engines/backends/trtllm_host.py:listen) and a worker's
`SharedLLM` (engines/backends/trtllm_shared.py) gives what the same engine gives in one process: every output
of the same requests, field by field (text, ids, finish, counts, OpenAI choice objects), for plain
text, stop strings, n > 1, best_of > n, logprobs and a length finish; TensorRT-LLM's refusals and a
dead executor read the same; a cancel reaches the host's LLM. Host and worker run in this process
on one loop, over the real socket; the LLM is the double (tests/fakes/trtllm.py)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from engines.base import EngineError, EngineRequest, EngineRequestRejected, SamplingParams
from engines.backends.trtllm import TRTLLMEngine
from engines.backends.trtllm_host import listen
from tests.conftest import until
from tests.fakes import trtllm as double

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Any:
    return double.install(monkeypatch)


async def started(api: Any, **settings: Any) -> TRTLLMEngine:
    engine = TRTLLMEngine(model_id="llama", model_path="/models/llama", api=api, **{"context_length": 4096, **settings})
    await engine.start()
    # The double's tokenizer learns words as it meets them; a real one is fixed. Both LLMs know the
    # story and the alternatives before the worker takes its copy, so their ids agree.
    engine._llm.tokenizer.encode(double.STORY)
    for piece, _ in double.LLM.top_alternatives:
        engine._llm.tokenizer.encode(piece)
    return engine


async def pair(api: Any, tmp_path: Path, **settings: Any) -> tuple[TRTLLMEngine, TRTLLMEngine, TRTLLMEngine, Any]:
    """(the engine in this process, the host's engine, a worker's engine over the host, the listener)."""
    direct, host = await started(api, **settings), await started(api, **settings)
    listener, _hello = listen(host, str(tmp_path / "host.sock"), None)
    worker = TRTLLMEngine(model_id="llama", model_path="/models/llama", **{"context_length": 4096, **settings})
    worker.connect_to = str(tmp_path / "host.sock")
    await worker.start()
    return direct, host, worker, listener


def request(engine: TRTLLMEngine, max_tokens: int = 100, extra: dict[str, Any] | None = None, n: int = 1, best_of: int = 1,
            **sampling: Any) -> EngineRequest:
    return EngineRequest(request_id=f"r{time.monotonic_ns()}", max_tokens=max_tokens, sampling=SamplingParams(**{"temperature": 0.0, **sampling}),
                         prompt_token_ids=engine.encode_chat(QUESTION), extra=extra, n=n, best_of=best_of)


def seen(outputs: list[Any]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(o) | {"first_token_at": None} for o in outputs]


async def collect(engine: TRTLLMEngine, req: EngineRequest) -> list[Any]:
    return [out async for out in engine.stream(req)]


CASES = {
    "plain": {},
    "stop string over two tokens": {"stop": (" capital of",)},
    "length": {"max_tokens": 5},
    "n=2 streamed": {"n": 2, "temperature": 1.0, "extra": {"messages": QUESTION, "stream": True}},
    "best_of=3 n=2": {"n": 2, "best_of": 3, "temperature": 1.0, "extra": {"prompt": "Tell me", "stream": False}},
    "logprobs streamed": {"max_tokens": 4, "extra": {"messages": QUESTION, "logprobs": True, "top_logprobs": 2, "stream": True}},
    "logprobs whole": {"max_tokens": 4, "extra": {"prompt": "Tell me", "logprobs": 2}},
}


@pytest.mark.parametrize("case", list(CASES))
async def test_the_worker_sees_what_the_engine_in_one_process_gives(api: Any, tmp_path: Path, case: str) -> None:
    direct, host, worker, listener = await pair(api, tmp_path)
    try:
        here = await collect(direct, request(direct, **CASES[case]))
        there = await collect(worker, request(worker, **CASES[case]))
        assert seen(there) == seen(here)
        assert here[-1].finish_reason is not None and here[-1].completion_tokens > 0
        assert len(host._llm.requests) == 1  # the worker's request ran on the host's LLM
    finally:
        listener.close()
        for engine in (worker, host, direct):
            await engine.stop()


async def test_refusals_and_a_dead_executor_read_the_same(api: Any, tmp_path: Path) -> None:
    direct, host, worker, listener = await pair(api, tmp_path, max_num_tokens=5)
    try:
        for engine in (direct, worker):  # refused before TensorRT-LLM: the limit read back from the host's llm.args
            with pytest.raises(EngineRequestRejected, match="max_num_tokens"):
                await collect(engine, request(engine))
        direct.max_prompt_tokens = worker.max_prompt_tokens = None
        answers = []
        for engine in (direct, worker):  # TensorRT-LLM's RequestError, raised in the host, is the same 400
            with pytest.raises(EngineRequestRejected) as refused:
                await collect(engine, request(engine))
            answers.append(str(refused.value))
        assert answers[0] == answers[1] and "max_num_tokens" in answers[0]
        answers = []
        for engine in (direct, worker):  # SamplingParams' own check (greedy with n > 1), built in the host
            with pytest.raises(EngineRequestRejected) as refused:
                await collect(engine, request(engine, max_tokens=3, n=2))
            answers.append(str(refused.value))
        assert answers[0] == answers[1] and "best_of" in answers[0]

        host._llm.args.values["max_num_tokens"] = 8192
        stream = worker.stream(request(worker))
        await anext(stream)
        host._llm.die()  # EngineDeadError on every pending result, in the host
        with pytest.raises(EngineError, match="EngineDeadError"):
            async for _ in stream:
                pass
        assert not worker.ready
    finally:
        listener.close()
        for engine in (worker, host, direct):
            await engine.stop()


async def test_a_cancel_reaches_the_host_and_a_closed_host_fails_the_worker(api: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double.LLM, "step_delay", 0.05)
    direct, host, worker, listener = await pair(api, tmp_path)
    try:
        req = request(worker)
        stream = worker.stream(req)
        await anext(stream)
        worker.cancel(req.request_id)
        outs = [o async for o in stream]
        assert outs[-1].finish_reason == "cancelled"
        await until(lambda: host._llm.aborts == [host._llm.requests[-1].request_id], "the host's LLM aborted the request")

        await host.stop()  # the host's LLM shuts down: the next request is refused as by a dead executor
        with pytest.raises(EngineError):
            await collect(worker, request(worker))
        assert not worker.ready
    finally:
        listener.close()
        for engine in (worker, direct):
            await engine.stop()
