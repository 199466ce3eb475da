"""The `trtllm` backend against the TensorRT-LLM test double (tests/fakes/trtllm.py): the double
reproduces the documented LLM API surface; nothing here ran on a GPU."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, RateLimitError

from engines.base import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, EngineError, EngineRequest, EngineRequestRejected, SamplingParams
from engines.registry import ModelsConfigError, parse_models
from engines.backends.trtllm import MISSING, TensorRTLLMMissing, TRTLLMEngine, require_tensorrt_llm
from gateway.cli import main as cli
from tests.fakes import trtllm as double

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Any:
    return double.install(monkeypatch)


async def started(api: Any, **settings: Any) -> TRTLLMEngine:
    engine = TRTLLMEngine(model_id="llama", model_path="/models/llama", api=api, **{"context_length": 4096, **settings})
    await engine.start()
    return engine


def request(engine: TRTLLMEngine, max_tokens: int = 100, **sampling: Any) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{time.monotonic_ns()}",
        max_tokens=max_tokens,
        sampling=SamplingParams(**{"temperature": 0.0, **sampling}),
        prompt_token_ids=engine.encode_chat(QUESTION),
    )


async def collect(engine: TRTLLMEngine, req: EngineRequest) -> list[Any]:
    return [out async for out in engine.stream(req)]


def last_request(engine: TRTLLMEngine) -> Any:
    return engine._llm.requests[-1]


async def test_llm_is_built_from_the_settings(api: Any) -> None:
    engine = await started(
        api, tensor_parallel_size=2, max_batch_size=64, max_num_tokens=8192, kv_cache_free_gpu_memory_fraction=0.85,
        scheduler_policy="max_utilization", llm_options={"enable_chunked_prefill": True},
    )
    args = engine._llm.args
    assert (args.model, args.tensor_parallel_size, args.max_batch_size, args.max_num_tokens, args.max_seq_len) == ("/models/llama", 2, 64, 8192, 4096)
    assert args.kv_cache_config.free_gpu_memory_fraction == 0.85
    assert args.scheduler_config.capacity_scheduler_policy is double.CapacitySchedulerPolicy.MAX_UTILIZATION
    assert args.enable_chunked_prefill is True and engine._llm.explicit_kwargs["enable_chunked_prefill"] is True
    assert engine.ready and engine.context_length == 4096
    assert engine.max_prompt_tokens is None  # chunked prefill: no prompt limit below the context
    await engine.stop()
    assert engine._llm is None


async def test_streams_increments_and_counts_from_the_engine_ids(api: Any) -> None:
    engine = await started(api)
    req = request(engine)
    outs = await collect(engine, req)
    result = last_request(engine)
    assert "".join(o.text for o in outs) == double.STORY
    assert [t for o in outs for t in o.token_ids] == result.outputs[0].token_ids  # the diffs add up to the engine's ids
    final = outs[-1]
    assert final.finish_reason == FINISH_STOP  # the end id
    assert (final.prompt_tokens, final.completion_tokens) == (len(result.prompt_token_ids), len(result.outputs[0].token_ids))
    assert result.prompt_token_ids == req.prompt_token_ids
    assert all(not o.estimated for o in outs) and all(o.finish_reason is None for o in outs[:-1])


async def test_max_tokens_is_always_set(api: Any) -> None:
    engine = await started(api)
    outs = await collect(engine, request(engine, max_tokens=5))
    assert last_request(engine).sampling_params.max_tokens == 5  # never TensorRT-LLM's default of 32
    assert (outs[-1].finish_reason, outs[-1].completion_tokens) == (FINISH_LENGTH, 5)
    params = engine.sampling_params(request(engine, max_tokens=700, temperature=0.7, top_p=0.9, seed=11, stop=("x",)))
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.stop, params.include_stop_str_in_output) == (
        700, 0.7, 0.9, 11, ["x"], False)
    assert engine.sampling_params(request(engine)).temperature == 0.0  # greedy


async def test_stop_string_trimmed_by_the_engine(api: Any) -> None:
    engine = await started(api)
    outs = await collect(engine, request(engine, stop=(" Paris.",)))
    result = last_request(engine)
    text = "".join(o.text for o in outs)
    assert text == double.STORY.split(" Paris.")[0]
    assert outs[-1].finish_reason == FINISH_STOP and result.outputs[0].stop_reason == " Paris."
    assert outs[-1].stop_sequence == " Paris."  # which one ended it: Anthropic's stop_sequence
    assert outs[-1].completion_tokens == len(result.outputs[0].token_ids)  # trimmed count
    assert result.outputs[0].token_ids == [t for o in outs for t in o.token_ids]  # the stop token was never streamed


async def test_stop_string_the_engine_cannot_see_is_cut_here(api: Any) -> None:
    # "Paris" never appears as a token of its own (the token is " Paris."), so TensorRT-LLM's
    # token matching misses it; the gateway cuts the text and aborts the request.
    engine = await started(api)
    outs = await collect(engine, request(engine, stop=("Paris",)))
    result = last_request(engine)
    assert "".join(o.text for o in outs) == double.STORY.split("Paris")[0]
    assert outs[-1].finish_reason == FINISH_STOP and outs[-1].stop_sequence == "Paris"
    assert result.request_id in engine._llm.aborts
    assert outs[-1].completion_tokens == sum(len(o.token_ids) for o in outs)


async def test_cancel_aborts_and_finishes_cancelled(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double.LLM, "step_delay", 0.02)
    engine = await started(api)
    req = request(engine)
    outs = []
    async for out in engine.stream(req):
        outs.append(out)
        if len(outs) == 3:
            engine.cancel(req.request_id)
    result = last_request(engine)
    assert result.request_id in engine._llm.aborts
    assert outs[-1].finish_reason == FINISH_CANCELLED and result.outputs[0].finish_reason == "cancelled"
    assert outs[-1].completion_tokens == len(result.outputs[0].token_ids) < len(double.STORY.split())
    assert engine._llm.running == 0 and engine.requests_in_flight() == 0


async def test_a_consumer_that_leaves_aborts_the_request(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double.LLM, "step_delay", 0.02)
    engine = await started(api)
    stream = engine.stream(request(engine))
    await anext(stream)
    await stream.aclose()
    result = last_request(engine)
    assert result.request_id in engine._llm.aborts
    await asyncio.wait_for(result._task, 2)  # the executor notices the abort at its next step
    assert engine._llm.running == 0


async def test_timeout_finish_reads_as_length(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double.LLM, "timeout_after", 3)
    engine = await started(api)
    outs = await collect(engine, request(engine))
    assert last_request(engine).outputs[0].finish_reason == "timeout"
    assert (outs[-1].finish_reason, outs[-1].completion_tokens) == (FINISH_LENGTH, 3)
    assert outs[-1].recorded_finish == "timeout"  # the client sees length, the ledger row timeout


async def test_capacity_is_the_batch_plus_the_queue(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double.LLM, "step_delay", 0.05)
    engine = await started(api, max_batch_size=1, max_queue=1)
    streams = [engine.stream(request(engine)) for _ in range(2)]
    firsts = await asyncio.gather(*(anext(s) for s in streams))
    assert all(f.text for f in firsts) and not engine.has_capacity()
    for s in streams:
        await s.aclose()
    assert engine.has_capacity()


def test_without_tensorrt_llm_the_backend_fails_at_start_up_with_one_message(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.delitem(sys.modules, "tensorrt_llm", raising=False)
    with pytest.raises(TensorRTLLMMissing) as info:
        require_tensorrt_llm()
    assert str(info.value) == MISSING
    with pytest.raises(ModelsConfigError) as config:
        parse_models("models:\n  - id: llama\n    backend: trtllm\n    model_path: /models/llama\n", "models.yaml")
    assert config.value.problems == [f"models.yaml:3: models[0].backend: {MISSING}"]
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - id: llama\n    backend: trtllm\n    model_path: /models/llama\n")
    assert cli.main(["serve", "--models", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("TensorRT-LLM") == 1 and f"{path}:3: models[0].backend" in err
    with pytest.raises(TensorRTLLMMissing):
        asyncio.run(TRTLLMEngine(model_id="llama", model_path="/models/llama").start())


# issue 20's defects ---------------------------------------------------------------------------------
async def until(predicate: Any, what: str) -> None:
    """Lets the loop run until the predicate holds (no timing: bounded in loop turns)."""
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def test_cancel_of_a_queued_request_ends_its_stream_and_frees_its_slot(api: Any) -> None:
    # Defect 1: TensorRT-LLM drops an aborted request still in its queue without a final output.
    engine = await started(api, max_batch_size=1)
    llm = engine._llm
    llm.hold.clear()  # the one running request holds the batch: the next one waits in TensorRT-LLM's queue
    running = engine.stream(request(engine))
    first = asyncio.ensure_future(anext(running))
    await until(lambda: llm.running == 1, "the first request runs")
    queued_req = request(engine)
    queued = asyncio.ensure_future(collect(engine, queued_req))
    await until(lambda: len(llm.waiting) == 1, "the second request waits in the executor's queue")
    engine.cancel(queued_req.request_id)
    outs = await asyncio.wait_for(queued, 2)  # ends by itself, although the engine never answers it
    assert [o.finish_reason for o in outs] == [FINISH_CANCELLED] and outs[0].completion_tokens == 0
    assert engine.requests_in_flight() == 1 and engine.has_capacity()  # its slot is free
    await until(lambda: llm.dropped == [2], "the executor dropped it")
    assert llm.requests[1].outputs[0].finish_reason is None  # no `cancelled` output ever came
    llm.hold.set()
    assert (await first).text
    await running.aclose()


async def test_cancel_after_output_waits_for_the_engine_cancelled_counts(api: Any) -> None:
    engine = await started(api)
    llm = engine._llm
    req = request(engine)
    stream = engine.stream(req)
    assert (await anext(stream)).token_ids
    llm.hold.clear()  # the engine does not step (nor answer the abort) until released
    engine.cancel(req.request_id)
    nxt = asyncio.ensure_future(anext(stream))
    await until(lambda: req.request_id in engine._live and engine._live[req.request_id].timer is not None, "grace timer")
    llm.hold.set()
    last = await asyncio.wait_for(nxt, 2)
    assert last.finish_reason == FINISH_CANCELLED and last.completion_tokens == len(llm.requests[-1].outputs[0].token_ids)
    assert await anext(stream, None) is None and engine.requests_in_flight() == 0


async def test_prompt_over_max_num_tokens_is_a_client_error(api: Any) -> None:
    # Defect 2: without chunked prefill TensorRT-LLM raises RequestError for such a prompt.
    engine = await started(api, max_num_tokens=5)
    assert engine.max_prompt_tokens == 5
    req = request(engine)
    assert len(req.prompt_token_ids) > 5
    with pytest.raises(EngineRequestRejected) as info:
        await collect(engine, req)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded" and "at most 5 prompt tokens" in str(info.value)
    assert engine._llm.requests == []  # refused before it reached the engine
    # A RequestError from generate_async itself (whatever its cause) is a 400 too, not an engine failure.
    engine.max_prompt_tokens = None
    with pytest.raises(EngineRequestRejected, match="max_num_tokens"):
        await collect(engine, request(engine))
    double.LLM.fail_next = ValueError("best_of (1) cannot be less than n (2)")
    with pytest.raises(EngineRequestRejected, match="best_of"):
        await collect(engine, request(engine))
    assert engine.ready
    chunked = await started(api, max_num_tokens=5, llm_options={"enable_chunked_prefill": True})
    assert chunked.max_prompt_tokens is None
    assert (await collect(chunked, request(chunked)))[-1].finish_reason == FINISH_STOP


async def test_a_multi_token_stop_string_never_leaks_its_head(api: Any) -> None:
    # Defect 3: " capital of" is two tokens; the engine trims their ids but its text keeps " capital".
    engine = await started(api)
    outs = await collect(engine, request(engine, stop=(" capital of",)))
    result = last_request(engine)
    assert result.outputs[0].finish_reason == "stop" and result.outputs[0].stop_reason == " capital of"
    assert result.outputs[0].text.endswith(" capital")  # what TensorRT-LLM's final text holds
    text = "".join(o.text for o in outs)
    assert text == double.STORY.split(" capital of")[0] and "capital" not in text
    assert outs[-1].finish_reason == FINISH_STOP and outs[-1].completion_tokens == len(result.outputs[0].token_ids)


async def test_a_dead_engine_is_not_ready_and_fails_its_requests(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Defect 4: EngineDeadError on the result; afterwards generate_async says "LLM is shutting down".
    engine = await started(api)
    llm = engine._llm
    stream = engine.stream(request(engine))
    assert (await anext(stream)).text
    llm.hold.clear()
    llm.die()
    with pytest.raises(EngineError, match="EngineDeadError") as info:
        await anext(stream)
    assert not isinstance(info.value, EngineRequestRejected)
    assert not engine.ready and not engine.has_capacity() and engine.requests_in_flight() == 0
    with pytest.raises(EngineError, match="not running"):
        await collect(engine, request(engine))
    # The other way it shows: generate_async refuses because the LLM is shutting down.
    other = await started(api)
    other._llm.shut_down = True
    with pytest.raises(EngineError, match="shutting down"):
        await collect(other, request(other))
    assert not other.ready


async def test_batch_size_and_sequence_length_are_always_passed(api: Any, tmp_path: Any) -> None:
    # Defect 5: TensorRT-LLM's own default batch is 2048; Tollgate schedules 256 unless told.
    engine = await started(api)
    llm = engine._llm
    assert llm.explicit_kwargs["max_batch_size"] == llm.args.max_batch_size == engine.slots() == 256
    assert llm.explicit_kwargs["max_seq_len"] == llm.args.max_seq_len == engine.context_length == 4096
    assert engine.capacity == 256 + 256
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    from_checkpoint = TRTLLMEngine(model_id="m", model_path=str(tmp_path), api=api)
    await from_checkpoint.start()
    assert from_checkpoint._llm.explicit_kwargs["max_seq_len"] == from_checkpoint.context_length == 8192
    assert from_checkpoint.max_prompt_tokens == 8192  # TensorRT-LLM's max_num_tokens default, from llm.args


# through the gateway --------------------------------------------------------------------------------
@pytest.fixture
def trtllm_gateway(api: Any, tollgate_with: Any) -> Any:
    return tollgate_with("""
    models:
      - id: llama
        backend: trtllm
        model_path: /models/llama
        context_length: 2048
        max_batch_size: 8
        scheduler_policy: guaranteed_no_evict
        kv_cache_free_gpu_memory_fraction: 0.9
    """)


async def test_gateway_serves_and_meters_the_trtllm_engine(trtllm_gateway: Any) -> None:
    gw = trtllm_gateway
    key = await gw.new_key()
    client = AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0)
    stream = await client.chat.completions.create(model="llama", messages=QUESTION, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == double.STORY
    engine = gw.engines()["llama"].primary.unwrapped()
    result = engine._llm.requests[-1]
    assert result.sampling_params.max_tokens == 2048 - len(result.prompt_token_ids)  # no max_tokens from the client: the room left
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(result.prompt_token_ids), len(result.outputs[0].token_ids))
    row = await gw.ledger_row(chunks[0].id.split("-", 1)[1])
    assert (row["prompt_tokens"], row["completion_tokens"], row["estimated"], row["status"]) == (
        usage.prompt_tokens, usage.completion_tokens, False, "completed")


async def test_gateway_disconnect_aborts_the_trtllm_request(trtllm_gateway: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double.LLM, "step_delay", 0.1)
    gw = trtllm_gateway
    key = (await gw.new_key())["key"]
    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        async with c.stream("POST", "/chat/completions", json={"model": "llama", "messages": QUESTION, "stream": True}) as resp:
            request_id = resp.headers["x-request-id"]
            seen = 0
            async for line in resp.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    seen += 1
                    if seen == 2:
                        break
    llm = gw.engines()["llama"].primary.unwrapped()._llm
    deadline = time.monotonic() + 2
    while llm.running:
        assert time.monotonic() < deadline, "the engine kept generating after the client left"
        await asyncio.sleep(0.02)
    assert llm.requests[-1].request_id in llm.aborts
    row = await gw.ledger_row(request_id)
    assert row["status"] == "cancelled"
    assert row["completion_tokens"] == len(llm.requests[-1].outputs[0].token_ids) >= 2


async def test_gateway_answers_400_for_a_prompt_over_max_num_tokens(api: Any, tollgate_with: Any) -> None:
    gw = tollgate_with("""
    models:
      - id: llama
        backend: trtllm
        model_path: /models/llama
        context_length: 2048
        max_num_tokens: 6
    """)
    key = (await gw.new_key())["key"]
    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        for stream in (False, True):
            resp = await c.post("/chat/completions", json={"model": "llama", "messages": QUESTION, "stream": stream})
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded", "messages")
            assert "at most 6 prompt tokens" in error["message"]
    assert gw.engines()["llama"].primary.unwrapped()._llm.requests == []


async def test_gateway_dead_engine_answers_503_and_is_not_ready(trtllm_gateway: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double.LLM, "step_delay", 0.05)
    gw = trtllm_gateway
    key = (await gw.new_key())["key"]
    engine = gw.engines()["llama"].primary.unwrapped()
    async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        assert (await c.get("/readyz")).status_code == 200
        async with c.stream("POST", "/v1/chat/completions", json={"model": "llama", "messages": QUESTION, "stream": True}) as resp:
            lines = resp.aiter_lines()
            async for line in lines:
                if '"content":"' in line and '"content":""' not in line:
                    break
            engine._llm.die()
            rest = [line async for line in lines]
        assert any('"engine_error"' in line and "EngineDeadError" in line for line in rest)
        assert not engine.ready
        assert (await c.get("/readyz")).status_code == 503
        after = await c.post("/v1/chat/completions", json={"model": "llama", "messages": QUESTION})
        assert after.status_code == 503 and after.json()["error"]["type"] == "service_unavailable"


# what users send, mapped to the engine ------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = ' Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def mapped_gateway(tollgate_with: Any, extra: str = "") -> Any:
    return tollgate_with(f"""
    models:
      - id: llama
        backend: trtllm
        model_path: /models/llama
        context_length: 2048
        tool_parser: hermes
        llm_options: {{guided_decoding_backend: xgrammar}}
{extra}
    """)


async def test_openai_fields_reach_sampling_params(api: Any, tollgate_with: Any) -> None:
    gw = mapped_gateway(tollgate_with)
    client = AsyncOpenAI(base_url=gw.v1, api_key=(await gw.new_key())["key"], max_retries=0)
    await client.chat.completions.create(model="llama", messages=QUESTION, max_tokens=7, presence_penalty=0.5, frequency_penalty=-0.25,
                                         seed=42, temperature=0.6, top_p=0.8, response_format={"type": "json_object"})
    llm = gw.engines()["llama"].primary.unwrapped()._llm
    p = llm.requests[-1].sampling_params
    assert (p.max_tokens, p.presence_penalty, p.frequency_penalty, p.seed, p.temperature, p.top_p) == (7, 0.5, -0.25, 42, 0.6, 0.8)
    assert p.guided_decoding == double.GuidedDecodingParams(json_object=True) and p.logprobs is None
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    await client.chat.completions.create(model="llama", messages=QUESTION, max_tokens=3,
                                         response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert llm.requests[-1].sampling_params.guided_decoding == double.GuidedDecodingParams(json=schema)


async def test_logprobs_reach_the_engine_and_the_client(api: Any, tollgate_with: Any) -> None:
    gw = mapped_gateway(tollgate_with)
    client = AsyncOpenAI(base_url=gw.v1, api_key=(await gw.new_key())["key"], max_retries=0)
    resp = await client.chat.completions.create(model="llama", messages=QUESTION, max_tokens=4, logprobs=True, top_logprobs=2)
    llm = gw.engines()["llama"].primary.unwrapped()._llm
    assert llm.requests[-1].sampling_params.logprobs == 2
    content = resp.choices[0].logprobs.content
    assert "".join(e.token for e in content) == resp.choices[0].message.content == " Once upon a time"
    assert all(e.logprob == -0.25 and [t.token for t in e.top_logprobs] == [e.token, " maybe", " perhaps"] for e in content)
    stream = await client.chat.completions.create(model="llama", messages=QUESTION, max_tokens=3, logprobs=True, stream=True)
    chunks = [c async for c in stream]
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [" Once", " upon", " a"] and all(e.top_logprobs == [] or len(e.top_logprobs) == 1 for e in streamed)
    text = await client.completions.create(model="llama", prompt="Tell me", max_tokens=2, logprobs=1)
    assert text.choices[0].logprobs.tokens == [" Once", " upon"] and text.choices[0].logprobs.text_offset == [0, 5]
    assert llm.requests[-1].sampling_params.logprobs == 1


async def test_fields_the_engine_cannot_honour_are_400s(api: Any, tollgate_with: Any) -> None:
    gw = tollgate_with("""
    models:
      - id: llama
        backend: trtllm
        model_path: /models/llama
        context_length: 2048
    """)
    key = (await gw.new_key())["key"]
    async with httpx.AsyncClient(base_url=gw.v1, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        cases = [
            ({"logit_bias": {"1": 5}}, "logit_bias"),
            ({"response_format": {"type": "json_object"}}, "response_format"),  # not started with a guided decoding backend
            ({"tools": TOOLS}, "tools"),  # no tool_parser for this model
            ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
        ]
        for extra, param in cases:
            resp = await c.post("/chat/completions", json={"model": "llama", "messages": QUESTION, **extra})
            assert resp.status_code == 400, (extra, resp.text)
            assert resp.json()["error"]["param"] == param and resp.json()["error"]["type"] == "invalid_request_error"
        resp = await c.post("/completions", json={"model": "llama", "prompt": "x", "echo": True})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo"
        for extra in ({"n": 17}, {"n": 2, "logprobs": True}, {"n": 2, "tools": TOOLS}):  # over max_choices; n with logprobs or tools
            resp = await c.post("/chat/completions", json={"model": "llama", "messages": QUESTION, **extra})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", (extra, resp.text)


async def test_tools_render_through_the_template_and_calls_come_back(api: Any, tollgate_with: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double.LLM, "continuation", CALL)
    gw = mapped_gateway(tollgate_with)
    client = AsyncOpenAI(base_url=gw.v1, api_key=(await gw.new_key())["key"], max_retries=0)
    resp = await client.chat.completions.create(model="llama", messages=QUESTION, tools=TOOLS)
    engine = gw.engines()["llama"].primary.unwrapped()
    assert engine._llm.tokenizer.templates[-1]["tools"] == TOOLS
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == " Let me check. "
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather", {"city": "Paris"})
    result = engine._llm.requests[-1]
    assert resp.usage.prompt_tokens == len(result.prompt_token_ids)  # the tools are in the billed prompt
    stream = await client.chat.completions.create(model="llama", messages=QUESTION, tools=TOOLS, stream=True)
    chunks = [c async for c in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == " Let me check. " and "<tool_call>" not in content
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # A tool result goes back through the template as the client sent it.
    follow = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
    await client.chat.completions.create(model="llama", messages=follow, tools=TOOLS, max_tokens=2)
    assert engine._llm.tokenizer.templates[-1]["conversation"][2] == {"role": "tool", "tool_call_id": call.id, "content": "18C"}


def test_tool_call_parsers_hold_back_markup_split_anywhere() -> None:
    from engines.decoding.tool_calls import parser_for

    text = 'Sure. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    for cut in range(1, len(text)):
        p = parser_for("hermes")
        c1, k1 = p.push(text[:cut])
        c2, k2 = p.push(text[cut:])
        c3, k3 = p.finish()
        assert c1 + c2 + c3 == "Sure. " and [(k.name, k.arguments) for k in k1 + k2 + k3] == [("a", '{"x": 1}'), ("b", "{}")]
        assert "<" not in c1 + c2  # never half a tag as content
    p = parser_for("hermes")
    assert p.push("<tool_call>not json</tool_call> done") == ("<tool_call>not json</tool_call> done", [])
    p = parser_for("llama3_json")
    assert p.push('{"name": "a", ') == ("", []) and p.push('"parameters": {"q": "x"}}') == ("", [])
    content, calls = p.finish()
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"q": "x"})]
    p = parser_for("llama3_json")
    assert p.push("Hello") == ("Hello", []) and p.finish() == ("", [])


# n / best_of: several choices per request -----------------------------------------------------------------
def story_from(word: int, tokens: int) -> str:
    """What the double's sequence `word` generates: the story from its word-th token."""
    return "".join(double.WordTokenizer._pieces.findall(double.STORY)[word:word + tokens])


async def test_gateway_n_choices_streamed_and_not_are_metered_as_their_sum(trtllm_gateway: Any) -> None:
    gw = trtllm_gateway
    client = AsyncOpenAI(base_url=gw.v1, api_key=(await gw.new_key())["key"], max_retries=0)
    llm = gw.engines()["llama"].primary.unwrapped()._llm
    expected = [story_from(i, 5) for i in range(3)]  # three different sequences, each cut at max_tokens
    # not streamed: three choices, indices 0..2
    resp = await client.chat.completions.create(model="llama", messages=QUESTION, n=3, max_tokens=5)
    p = llm.requests[-1].sampling_params
    assert (p.n, p.best_of, p.max_tokens) == (3, 3, 5)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.message.content for c in resp.choices] == expected and {c.finish_reason for c in resp.choices} == {"length"}
    per_choice = [len(o.token_ids) for o in llm.requests[-1].outputs]
    assert per_choice == [5, 5, 5] and resp.usage.completion_tokens == sum(per_choice) == 15
    row = await gw.ledger_row(resp.id.split("-", 1)[1])
    assert (row["prompt_tokens"], row["completion_tokens"], row["status"]) == (resp.usage.prompt_tokens, 15, "completed")
    # streamed: chunks whose choices carry their index; the usage chunk holds the sum
    stream = await client.chat.completions.create(model="llama", messages=QUESTION, n=3, max_tokens=5, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert [texts[i] for i in sorted(texts)] == expected and sorted(texts) == [0, 1, 2]
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}  # one finish per choice
    usage = chunks[-1].usage
    assert usage.completion_tokens == sum(len(o.token_ids) for o in llm.requests[-1].outputs) == 15
    row = await gw.ledger_row(chunks[0].id.split("-", 1)[1])
    assert (row["completion_tokens"], row["status"]) == (usage.completion_tokens, "completed")
    # text completions, streamed: the same
    stream = await client.completions.create(model="llama", prompt="Tell me", n=3, max_tokens=4, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    texts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == [story_from(i, 4) for i in range(3)] and chunks[-1].usage.completion_tokens == 12
    await gw.flush_ledger()
    assert await gw.ledger_count(key_id=row["key_id"]) == 3  # one row per request, not per choice


async def test_gateway_best_of_bills_every_generated_sequence(trtllm_gateway: Any) -> None:
    gw = trtllm_gateway
    client = AsyncOpenAI(base_url=gw.v1, api_key=(await gw.new_key())["key"], max_retries=0)
    llm = gw.engines()["llama"].primary.unwrapped()._llm
    resp = await client.completions.create(model="llama", prompt="Tell me", n=2, best_of=4, max_tokens=3)
    result = llm.requests[-1]
    assert (result.sampling_params.n, result.sampling_params.best_of) == (2, 4)
    # the two best by cumulative logprob (the double's sequence i scores -0.25 (i + 1) per token), re-indexed
    assert [(c.index, c.text) for c in resp.choices] == [(0, story_from(0, 3)), (1, story_from(1, 3))]
    assert resp.usage.completion_tokens == 4 * 3  # all four sequences were computed: all are billed
    row = await gw.ledger_row(resp.id.split("-", 1)[1])
    assert row["completion_tokens"] == 12
    with pytest.raises(BadRequestError) as refused:  # OpenAI's rule: the best of several is known only at the end
        await client.completions.create(model="llama", prompt="Tell me", n=1, best_of=2, max_tokens=3, stream=True)
    assert refused.value.body["param"] == "best_of"


async def test_gateway_reserves_n_times_max_tokens(trtllm_gateway: Any) -> None:
    gw = trtllm_gateway
    n, max_tokens, k = 3, 4, 4
    probe = AsyncOpenAI(base_url=gw.v1, api_key=(await gw.new_key())["key"], max_retries=0)
    prompt = (await probe.chat.completions.create(model="llama", messages=QUESTION, max_tokens=1)).usage.prompt_tokens
    per_request = prompt + n * max_tokens  # what each request reserves, and (cut at max_tokens) uses
    key = await gw.new_key()
    async with gw.admin_client() as admin:
        r = await admin.patch(f"/admin/keys/{key['id']}", json={"limits": {"monthly_tokens": k * per_request + per_request - 1}})
        assert r.status_code == 200, r.text
    client = AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0)

    async def one() -> Any:
        try:
            return await client.chat.completions.create(model="llama", messages=QUESTION, n=n, max_tokens=max_tokens)
        except RateLimitError as exc:
            return exc

    results = await asyncio.gather(*[one() for _ in range(3 * k)])
    served = [r for r in results if not isinstance(r, Exception)]
    assert all(r.usage.total_tokens == per_request for r in served)
    assert len(served) == k  # exactly: a reservation of prompt + max_tokens would admit more
    assert all(r.body["code"] == "monthly_tokens" for r in results if isinstance(r, Exception))
    await gw.flush_ledger()
    assert await gw.ledger_count(key_id=key["id"]) == k


# a request the executor finished is not aborted; a silent dead executor does not hang streams ---------
async def test_requests_the_executor_ended_are_not_aborted(api: Any) -> None:
    engine = await started(api)
    for req in (request(engine), request(engine, max_tokens=5), request(engine, stop=(" Paris.",))):  # end id, length, stop ids
        await collect(engine, req)
        assert last_request(engine).finished and last_request(engine).outputs[0].finish_reason in ("stop", "length")
    assert engine._llm.aborts == []
    # a stop TensorRT-LLM found in the text only: the executor generates on, so that one is aborted
    await collect(engine, request(engine, stop=("Paris",)))
    assert engine._llm.aborts == [last_request(engine).request_id]


async def test_a_silently_dead_executor_ends_streams_and_the_engine_turns_not_ready(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double.LLM, "step_delay", 0.02)
    engine = await started(api, output_timeout=0.3)
    streams = [engine.stream(request(engine)) for _ in range(2)]
    firsts = [await anext(s) for s in streams]
    assert all(f.text for f in firsts)
    engine._llm.die(silently=True)  # TensorRT-LLM 1.0-1.2: no EngineDeadError, nothing answers
    started_at = time.monotonic()
    async def drain(s: Any) -> None:
        async for _ in s:
            pass

    for s in streams:
        with pytest.raises(EngineError, match="not running"):
            await asyncio.wait_for(drain(s), 5.0)  # a TimeoutError here: the stream hung
    assert time.monotonic() - started_at < 3.0
    assert not engine.ready and not engine.has_capacity()


async def test_a_request_queued_behind_a_busy_executor_is_not_taken_for_dead(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double.LLM, "step_delay", 0.03)
    engine = await started(api, max_batch_size=1, output_timeout=0.25)
    first, second = request(engine, max_tokens=20), request(engine, max_tokens=3)
    began = time.monotonic()
    outs = await asyncio.gather(collect(engine, first), collect(engine, second))  # the second waits its turn without output
    assert time.monotonic() - began > 2 * 0.25  # longer than output_timeout, while the first streamed
    assert outs[0][-1].finish_reason == FINISH_STOP and outs[1][-1].finish_reason == FINISH_LENGTH and engine.ready


def test_models_yaml_sets_the_output_timeout(api: Any) -> None:
    from engines.registry import build_engine

    table = parse_models("models:\n  - id: llama\n    backend: trtllm\n    model_path: /m\n    output_timeout: 45\n", "models.yaml")
    engine = build_engine(table.specs["llama"], trtllm_api=api)
    assert engine.output_timeout == 45  # type: ignore[attr-defined]
    with pytest.raises(ModelsConfigError, match="output_timeout"):
        parse_models("models:\n  - id: llama\n    backend: trtllm\n    model_path: /m\n    output_timeout: 0\n", "models.yaml")


async def test_an_answer_cut_short_by_a_timeout_is_not_cached(api: Any, tollgate_with: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import on_server_loop

    gw = tollgate_with("""
    models:
      - id: llama
        backend: trtllm
        model_path: /models/llama
        context_length: 2048
        cache: true
    """)
    key = await gw.new_key()
    client = AsyncOpenAI(base_url=gw.v1, api_key=key["key"], max_retries=0)
    llm = gw.engines()["llama"].primary.unwrapped()._llm
    cache = gw.app.state.response_cache

    async def ask() -> Any:
        resp = await client.chat.completions.create(model="llama", messages=QUESTION, max_tokens=50, temperature=0)
        await on_server_loop(gw.app, cache.flush())  # the store holds whatever this answer left there
        return resp

    monkeypatch.setattr(double.LLM, "timeout_after", 3)
    cut = await ask()
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    row = await gw.ledger_row(cut.id.split("-", 1)[1])
    assert (row["finish_reason"], row["status"]) == ("timeout", "completed")
    monkeypatch.setattr(double.LLM, "timeout_after", None)
    before = len(llm.requests)
    whole = await ask()  # a miss: the engine answers again, in full
    assert len(llm.requests) == before + 1 and whole.choices[0].message.content == double.STORY
    again = await ask()  # and that one is cached
    assert len(llm.requests) == before + 1 and again.choices[0].message.content == double.STORY
