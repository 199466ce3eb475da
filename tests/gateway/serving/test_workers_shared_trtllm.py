"""`tollgate serve --workers 2` over one `trtllm` engine host (engines/backends/trtllm_host.py): the LLM is held
by one process and its batch is one, each worker streams and meters its own requests, the shared quota
and the ledger stay exact, the scheduler's reserve applies to the engine as a whole, and a worker killed
mid-stream takes none of it down. TensorRT-LLM is the test double (tests/fakes/trtllm.py), imported as
`tensorrt_llm` in every process through tests/fakes/trtllm_site on PYTHONPATH."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil
from openai import AsyncOpenAI

from tests.conftest import REDIS_URL, require_redis, run_coro, seconds_to_room_in_minute
from tests.fakes import trtllm as double
from tests.gateway.serving.test_workers import journal_finals
from tests.processes import GatewayProcess

ROOT = Path(__file__).resolve().parents[3]
MODELS = """models:
  - id: llama
    backend: trtllm
    model_path: /models/llama
    context_length: 2048
    max_batch_size: {batch}
    max_queue: 64
"""
# The double's story as its tokenizer splits it, and the end-of-sequence token it finishes on.
STORY_TOKENS = len(double.WordTokenizer().encode(double.STORY)) + 1


def start(fresh_pg_database: Any, tmp_path: Path, *, batch: int = 8, step_delay: float = 0.01, **env: str) -> tuple[GatewayProcess, Path]:
    require_redis(REDIS_URL)
    models = tmp_path / "models.yaml"
    models.write_text(MODELS.format(batch=batch))
    record = tmp_path / "llm-record.jsonl"
    site = f"{ROOT / 'tests' / 'fakes' / 'trtllm_site'}{os.pathsep}{ROOT}"
    gw = GatewayProcess(
        fresh_pg_database(), tmp_path / "data", "sk-admin-" + uuid.uuid4().hex, REDIS_URL=REDIS_URL,
        TOLLGATE_REDIS_PREFIX=f"tgtest:st:{uuid.uuid4().hex[:8]}:", TOLLGATE_WORKERS="2", TOLLGATE_MODELS=str(models),
        TOLLGATE_EMBEDDINGS="off", TOLLGATE_REDIS_TIMEOUT_MS="1000", PYTHONPATH=site,
        TOLLGATE_TEST_TRTLLM_RECORD=str(record), TOLLGATE_TEST_TRTLLM_STEP_DELAY=str(step_delay), **env,
    ).start()
    return gw, record


def records(path: Path, event: str = "generate") -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["event"] == event]


def _command(process: psutil.Process) -> str:
    """A process's command line; "" for one that has ended (a killed worker is a zombie until reaped)."""
    try:
        return " ".join(process.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return ""


def engine_host(gw: GatewayProcess) -> psutil.Process:
    assert gw.proc is not None
    hosts = [p for p in psutil.Process(gw.proc.pid).children(recursive=True) if "engines.backends.trtllm_host" in _command(p)]
    assert len(hosts) == 1 and hosts[0].ppid() == gw.proc.pid, hosts  # one LLM, the supervisor's, none per worker
    return hosts[0]


async def stream(client: httpx.AsyncClient, key: str, seed: int, on_first: Any = None, max_tokens: int | None = None) -> tuple[str, str, int, int, float]:
    """One streamed chat completion through the openai SDK on this client's one connection: (request id,
    text, usage's prompt and completion tokens, seconds to the first content). `seed` tags the request
    in the double's record."""
    sdk = AsyncOpenAI(base_url=str(client.base_url) + "/v1", api_key=key, max_retries=0, http_client=client)
    started = time.perf_counter()
    first = float("inf")
    rid, text, usage = "", "", (-1, -1)
    extra = {"max_tokens": max_tokens} if max_tokens else {}
    async for chunk in await sdk.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Tell me a story"}], seed=seed,
                                                         stream=True, stream_options={"include_usage": True}, **extra):
        rid = chunk.id.split("-", 1)[1]
        if chunk.choices and chunk.choices[0].delta.content:
            if first == float("inf"):
                first = time.perf_counter() - started
                if on_first is not None:
                    on_first(seed)
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    return rid, text, usage[0], usage[1], first


async def ledger_rows(db_url: str, count: int) -> dict[str, tuple[int, int, str]]:
    """request id -> (prompt tokens, completion tokens, status), once `count` rows have reached Postgres."""
    conn = await asyncpg.connect(db_url)
    try:
        deadline = time.monotonic() + 30
        while True:  # rows reach the database within the writers' linger
            rows = await conn.fetch("SELECT request_id, prompt_tokens, completion_tokens, status FROM ledger_entries")
            if len(rows) >= count or time.monotonic() > deadline:
                return {r["request_id"]: (r["prompt_tokens"], r["completion_tokens"], r["status"]) for r in rows}
            await asyncio.sleep(0.2)
    finally:
        await conn.close()


def test_two_workers_share_one_trtllm_engine_with_exact_quota_and_ledger(fresh_pg_database: Any, tmp_path: Path) -> None:
    gw, record = start(fresh_pg_database, tmp_path, step_delay=0.01)
    try:
        workers = gw.workers()
        assert len(workers) == 2
        host = engine_host(gw)
        made = run_coro(gw.new_key())
        key = made["key"]
        with httpx.Client(base_url=gw.base_url, headers={"Authorization": f"Bearer {gw.admin_key}"}, timeout=30) as admin:
            assert admin.patch(f"/admin/keys/{made['id']}", json={"limits": {"rpm": 12}}).status_code == 200

        async def fire() -> list[Any]:
            clients = [await gw.client_on_worker(w, timeout=60) for w in workers]
            try:
                answers: list[Any] = []
                for n in range(8):  # one stream on each worker at once (seed 100+i: worker i), 16 in all against rpm 12
                    answers += await asyncio.gather(*(stream(c, key, 100 + i) for i, c in enumerate(clients)), return_exceptions=True)
                    del n
                return answers
            finally:
                for c in clients:
                    await c.aclose()

        time.sleep(seconds_to_room_in_minute(30))  # the 16 requests in one minute's window
        answers = run_coro(fire())
        served = [a for a in answers if not isinstance(a, BaseException)]
        refused = [a for a in answers if isinstance(a, BaseException)]
        assert len(served) == 12 and all(getattr(e, "status_code", None) == 429 for e in refused), refused  # one limit across both
        for _rid, text, _prompt, completion, _first in served:
            assert text == double.STORY and completion == STORY_TOKENS  # the host's LLM's output, relayed by the worker

        per_worker = [journal_finals(gw.data_dir / name) for name in ("journal", "journal-1")]
        assert all(per_worker) and per_worker[0].isdisjoint(per_worker[1])  # both workers served and metered
        rows = run_coro(ledger_rows(gw.db_url, 12))
        assert rows == {rid: (prompt, completion, "completed") for rid, _t, prompt, completion, _f in served}  # rows == what was streamed

        generated = records(record)
        assert {r["pid"] for r in generated} == {host.pid}  # every worker's requests reached the one LLM in the host
        assert {r["seed"] for r in generated} == {100, 101}
        assert any(r["seeds_unfinished"] == [100, 101] for r in generated), generated  # in its batch together
    finally:
        gw.stop()


def test_the_reserve_holds_for_the_trtllm_engine_as_a_whole_across_workers(fresh_pg_database: Any, tmp_path: Path) -> None:
    # A heavy account fills the engine's regular slots (3 of 4, reserve 1) through both workers; a light
    # account's request then takes the reserved slot at once. With a queue per worker (or none) the
    # LLM's batch of 4 would fill with heavy streams and the light one would wait in TensorRT-LLM's queue.
    gw, _record = start(fresh_pg_database, tmp_path, batch=4, step_delay=0.1, TOLLGATE_SCHEDULER_RESERVE="1")
    try:
        heavy, light = run_coro(gw.new_key())["key"], run_coro(gw.new_key())["key"]

        heavy_runs, (_rid, text, _p, tokens, first) = run_coro(gw.heavy_then_light(  # both workers send heavy requests
            lambda c, started: stream(c, heavy, 1, started, max_tokens=STORY_TOKENS), lambda b: stream(b, light, 2)))
        assert text == double.STORY and tokens == STORY_TOKENS
        assert all(t == STORY_TOKENS for _, _, _, t, _ in heavy_runs)
        # Each heavy stream runs ~27 steps of 100 ms (2.7 s or more); the light one waits for none of them.
        assert first < 1.2, first
    finally:
        gw.stop()


def test_a_worker_killed_mid_stream_leaves_the_trtllm_engine_serving(fresh_pg_database: Any, tmp_path: Path) -> None:
    gw, record = start(fresh_pg_database, tmp_path, step_delay=0.05)
    try:
        victim, survivor = gw.workers()
        host = engine_host(gw)
        key = run_coro(gw.new_key())["key"]

        async def scenario() -> list[Any]:
            first: list[int] = []
            doomed = [await gw.client_on_worker(victim, timeout=60) for _ in range(2)]
            kept = [await gw.client_on_worker(survivor, timeout=60) for _ in range(2)]
            try:
                runs = [asyncio.create_task(stream(c, key, 200, first.append)) for c in doomed]
                runs += [asyncio.create_task(stream(c, key, 201, first.append)) for c in kept]
                deadline = time.monotonic() + 30
                while len(first) < 4:  # every stream is under way in the one batch
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                os.kill(victim.pid, signal.SIGKILL)
                return await asyncio.gather(*runs, return_exceptions=True)
            finally:
                for c in doomed + kept:
                    await c.aclose()

        outcomes = run_coro(scenario())
        assert all(isinstance(o, BaseException) for o in outcomes[:2]), outcomes[:2]  # the killed worker's streams broke off
        for _rid, text, _p, tokens, _f in outcomes[2:]:
            assert text == double.STORY and tokens == STORY_TOKENS, outcomes[2:]  # the other worker's went on to the end
        deadline = time.monotonic() + 10
        while len(records(record, "abort")) < 2:  # the host aborted the killed worker's requests (a poll of the record)
            assert time.monotonic() < deadline, records(record, "abort")
            time.sleep(0.05)
        assert {r["seed"] for r in records(record, "abort")} == {200}
        assert host.is_running() and engine_host(gw).pid == host.pid  # the engine host lives on

        fresh = gw.replacement(victim, [survivor])

        async def again() -> Any:
            client = await gw.client_on_worker(fresh, timeout=60)
            try:
                return await stream(client, key, 202)
            finally:
                await client.aclose()

        _rid, text, _p, tokens, _f = run_coro(again())  # the new worker connects to the same engine host
        assert text == double.STORY and tokens == STORY_TOKENS
        assert records(record)[-1]["pid"] == host.pid
    finally:
        gw.stop()


def test_the_engine_host_killed_turns_every_worker_not_ready(fresh_pg_database: Any, tmp_path: Path) -> None:
    gw, _record = start(fresh_pg_database, tmp_path)
    try:
        workers = gw.workers()
        key = run_coro(gw.new_key())["key"]
        engine_host(gw).kill()  # SIGKILL: the LLM is gone, and every worker's connection to it with it

        async def after() -> list[Any]:
            answers = []
            for worker in workers:
                client = httpx.AsyncClient(base_url=gw.base_url, limits=httpx.Limits(max_connections=1))
                others = [w for w in workers if w.pid != worker.pid]
                try:
                    deadline = time.monotonic() + 30
                    while True:  # this worker's /readyz (the others stopped for the one request, as client_on_worker does)
                        for other in others:
                            other.suspend()
                        try:
                            status = (await client.get("/readyz")).status_code
                        finally:
                            for other in others:
                                other.resume()
                        if status == 503:
                            break
                        assert time.monotonic() < deadline, "a worker still ready with its engine host gone"
                        await asyncio.sleep(0.05)
                    sdk = AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, http_client=client)
                    try:
                        await sdk.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], stream=True)
                    except Exception as exc:  # noqa: BLE001 - the answer is what is checked
                        answers.append(getattr(exc, "status_code", exc))
                finally:
                    await client.aclose()
            return answers

        assert run_coro(after()) == [503, 503]
    finally:
        gw.stop()
