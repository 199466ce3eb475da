"""Graceful drain (gateway/http/drain.py) on a real `tollgate serve` process: on SIGTERM /readyz turns 503
at once, new requests get 503 with Retry-After in their API's error shape (OpenAI and Anthropic, seen
through the official SDKs), a stream that ends within TOLLGATE_DRAIN_SECONDS completes, streams still
running then are cut with an error event, their rows written (`interrupted`) and their holds settled;
the process exits 0. Postgres and Redis are the shared ones (a fresh database, a private key prefix)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import MODEL, REDIS_URL, SECRET, bootstrap, require_redis
from tests.engines.conftest import upstreams  # noqa: F401  (fixture)
from tests.fakes.upstream import Behaviour
from tests.gateway.serving.test_durable_metering import ledger_ids, redis_counters
from tests.gateway.serving.test_workers import MODELS, _models
from tests.processes import GatewayProcess

DRAIN_SECONDS = 20.0  # the short stream has one token left at the signal; on 2 busy cores a token took up to 8 s
LONG = [{"role": "user", "content": "Write a very long story about a lighthouse keeper and the sea."}]


class Stream:
    """One streamed request read line by line: the first content event, then how it ended."""

    def __init__(self) -> None:
        self.request_id: str | None = None
        self.first = asyncio.Event()
        self.events: list[dict[str, Any]] = []
        self.done = False  # OpenAI's [DONE] or Anthropic's message_stop
        self.ended_at = 0.0

    async def run(self, client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            self.request_id = r.headers["x-request-id"]
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    self.events.append(event)
                    self.done = self.done or event.get("type") == "message_stop"
                    if _has_text(event):
                        self.first.set()
        self.ended_at = time.monotonic()

    @property
    def error(self) -> dict[str, Any] | None:
        last = self.events[-1] if self.events else {}
        return last.get("error") if isinstance(last.get("error"), dict) else None


def _has_text(event: dict[str, Any]) -> bool:
    if event.get("type") == "content_block_delta":
        return bool(event["delta"].get("text"))
    choices = event.get("choices") or []
    return bool(choices and (choices[0].get("delta") or {}).get("content"))


async def test_sigterm_drains_streams_then_cuts_them_with_rows_and_settled_holds(fresh_pg_database: Any, tmp_path: Path) -> None:
    require_redis(REDIS_URL)
    url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(url, SECRET)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    gw = GatewayProcess(url, tmp_path / "data", admin_key, REDIS_URL=REDIS_URL, TOLLGATE_REDIS_PREFIX=prefix,
                        TOLLGATE_DRAIN_SECONDS=str(DRAIN_SECONDS)).start()
    try:
        key = await gw.new_key()
        async with gw.admin() as a:
            assert (await a.patch(f"/admin/keys/{key['id']}", json={"limits": {"monthly_tokens": 10_000_000}})).status_code == 200
        auth = {"Authorization": f"Bearer {key['key']}"}
        async with httpx.AsyncClient(base_url=gw.base_url, headers=auth, timeout=120) as c:
            warm = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": LONG, "max_tokens": 1})  # first-run costs
            assert warm.status_code == 200, warm.text
            chat_long, messages_long, short = Stream(), Stream(), Stream()
            tasks = [
                asyncio.create_task(chat_long.run(c, "/v1/chat/completions", {
                    "model": MODEL, "messages": LONG, "max_tokens": 1000, "temperature": 0, "stream": True})),
                asyncio.create_task(messages_long.run(c, "/v1/messages", {
                    "model": MODEL, "messages": LONG, "max_tokens": 1000, "temperature": 0, "stream": True})),
            ]
            await asyncio.wait_for(asyncio.gather(chat_long.first.wait(), messages_long.first.wait()), 120)
            tasks.append(asyncio.create_task(short.run(c, "/v1/chat/completions", {
                "model": MODEL, "messages": LONG, "max_tokens": 2, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}})))
            await asyncio.wait_for(short.first.wait(), 60)
            assert not short.done  # all three are mid-stream at the signal

            gw.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            async with httpx.AsyncClient(base_url=gw.base_url, timeout=10) as probe:
                while (ready := await probe.get("/readyz")).status_code == 200:
                    assert time.monotonic() - signalled < 2.0, "readyz still 200 two seconds after SIGTERM"
                unready_after = time.monotonic() - signalled
                assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
                assert (await probe.get("/healthz")).status_code == 200  # alive: the liveness probe must not kill it

            # A new request on this process: 503 with Retry-After, in each API's own error shape.
            oa = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key["key"], max_retries=0)
            with pytest.raises(openai.APIStatusError) as refused:
                await oa.chat.completions.create(model=MODEL, messages=LONG, max_tokens=2)
            await oa.close()
            assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
            assert refused.value.response.json()["error"]["code"] == "server_draining"
            an = anthropic.AsyncAnthropic(base_url=gw.base_url, api_key=key["key"], max_retries=0)
            with pytest.raises(anthropic.APIStatusError) as refused_a:
                await an.messages.create(model=MODEL, messages=LONG, max_tokens=2)
            await an.close()
            assert refused_a.value.status_code == 503 and refused_a.value.response.headers["retry-after"] == "1"
            body = refused_a.value.response.json()
            assert body["type"] == "error" and body["error"]["type"] == "api_error" and "shutting down" in body["error"]["message"]

            await asyncio.wait_for(asyncio.gather(*tasks), DRAIN_SECONDS + 60)
        rc = gw.proc.wait(timeout=60)
        gw.proc = None
        exited_after = time.monotonic() - signalled

        # The short stream ended by itself inside the window, whole.
        assert short.done and short.error is None and short.ended_at - signalled < DRAIN_SECONDS
        # The long ones ran until the deadline, then were cut with an error event in their API's shape.
        for cut in (chat_long, messages_long):
            assert cut.error is not None, cut.events[-3:]  # the last event (OpenAI's error chunk is followed by [DONE])
            assert cut.ended_at - signalled >= DRAIN_SECONDS - 0.5
        assert chat_long.error["code"] == "server_draining"
        assert messages_long.events[-1]["type"] == "error" and messages_long.error["type"] == "api_error" and not messages_long.done
        assert rc == 0, gw.log_text()[-3000:]

        rows = await ledger_ids(url, key["id"])
        assert set(rows) == {warm.headers["x-request-id"], short.request_id, chat_long.request_id, messages_long.request_id}
        assert rows[short.request_id]["status"] == "completed"
        usage = short.events[-1]["usage"]
        assert rows[short.request_id]["completion_tokens"] == usage["completion_tokens"] == 2
        for cut in (chat_long, messages_long):
            row = rows[cut.request_id]
            assert row["status"] == "interrupted" and row["finish_reason"] == "cancelled", row
            assert row["prompt_tokens"] > 0 and 0 < row["completion_tokens"] < 1000
        counters = await redis_counters(REDIS_URL, prefix, url, key["id"])
        tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows.values())
        assert counters["in_flight"] == 0 and counters["month_tokens"] == tokens, (counters, tokens)  # holds settled, exactly
        assert "cut 2 generations" in gw.log_text()
        print(f"\ndrain: readyz 503 {unready_after * 1000:.0f} ms after SIGTERM; short stream done at "
              f"{short.ended_at - signalled:.1f}s; 2 streams cut at {chat_long.ended_at - signalled:.1f}s "
              f"({rows[chat_long.request_id]['completion_tokens']} and {rows[messages_long.request_id]['completion_tokens']} tokens); "
              f"exit {rc} after {exited_after:.1f}s")
    finally:
        gw.stop()


@pytest.mark.parametrize("signals", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT,)])
async def test_a_second_sigterm_or_sigint_cuts_what_runs_and_stops_at_once(fresh_pg_database: Any, tmp_path: Path,
                                                                          signals: tuple[int, ...]) -> None:
    """The drain gives running streams TOLLGATE_DRAIN_SECONDS; an operator who sends SIGTERM again, or
    SIGINT (Ctrl-C), wants the stop now: the streams are cut at once, as at the deadline (an error
    event; rows `interrupted`), and the process exits 0. Before, uvicorn's own stop waited for every
    open stream to end: the whole drain time after a second SIGTERM, and with SIGINT alone for as
    long as the stream ran (the operator audit: still generating 28 s later)."""
    url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(url, SECRET)
    gw = GatewayProcess(url, tmp_path / "data", admin_key, TOLLGATE_DRAIN_SECONDS="600").start()
    try:
        key = await gw.new_key()
        async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {key['key']}"}, timeout=120) as c:
            long = Stream()
            task = asyncio.create_task(long.run(c, "/v1/chat/completions", {
                "model": MODEL, "messages": LONG, "max_tokens": 4000, "temperature": 0, "stream": True}))
            await asyncio.wait_for(long.first.wait(), 120)
            for sig in signals:
                gw.proc.send_signal(sig)
                if sig == signal.SIGTERM and len(signals) > 1:  # the first: the drain has begun
                    async with httpx.AsyncClient(base_url=gw.base_url, timeout=10) as probe:
                        while (await probe.get("/readyz")).status_code == 200:
                            await asyncio.sleep(0.05)
            signalled = time.monotonic()
            await asyncio.wait_for(task, 60)
        rc = gw.proc.wait(timeout=60)
        gw.proc = None
        assert long.error is not None and long.error["code"] == "server_draining", long.events[-2:]
        assert long.ended_at - signalled < 30  # not the 600 s drain, nor the 4,000 tokens
        assert rc == 0, gw.log_text()[-3000:]
        row = (await ledger_ids(url, key["id"]))[long.request_id]
        assert row["status"] == "interrupted" and 0 < row["completion_tokens"] < 4000, row
    finally:
        gw.stop()


def journal_admitted(directory: Path) -> set[str]:
    """Request ids a worker's ledger journal has admission lines for (`{"a": row, ...}`)."""
    ids = set()
    for segment in sorted(directory.glob("ledger-*.jsonl")):
        for line in segment.read_bytes().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # the worker is appending to it right now
            if "a" in entry:
                ids.add(entry["a"]["request_id"])
    return ids


WORKER_DRAIN_SECONDS = 8.0


async def test_sigterm_to_the_master_drains_every_worker(upstreams: Any, fresh_pg_database: Any, tmp_path: Path) -> None:  # noqa: F811
    """`--workers 2`: SIGTERM to the master drains each worker as one process drains: readyz 503 at
    once, new requests 503 with Retry-After, a stream that ends inside TOLLGATE_DRAIN_SECONDS
    completes, streams on both workers still running then are cut (rows `interrupted`, holds
    settled), every worker and the master exit 0."""
    require_redis(REDIS_URL)
    upstream, upstream_url = upstreams()
    upstream.default = Behaviour(tokens=["word "] * 4000, token_delay=0.2)  # minutes long: runs until cut
    url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(url, SECRET)
    prefix = f"tgtest:{uuid.uuid4().hex[:8]}:"
    gw = GatewayProcess(url, tmp_path / "data", admin_key, REDIS_URL=REDIS_URL, TOLLGATE_REDIS_PREFIX=prefix,
                        TOLLGATE_WORKERS="2", TOLLGATE_MODELS=_models(tmp_path, MODELS.format(url=upstream_url)),
                        TOLLGATE_EMBEDDINGS="off", TOLLGATE_DRAIN_SECONDS=str(WORKER_DRAIN_SECONDS)).start()
    clients: list[httpx.AsyncClient] = []
    try:
        key = await gw.new_key()
        async with gw.admin() as a:
            assert (await a.patch(f"/admin/keys/{key['id']}", json={"limits": {"monthly_tokens": 10_000_000}})).status_code == 200
        auth = {"Authorization": f"Bearer {key['key']}"}
        body = {"model": "remote", "messages": LONG, "max_tokens": 4000, "stream": True, "stream_options": {"include_usage": True}}
        journals = [gw.data_dir / "journal", gw.data_dir / "journal-1"]
        # One long stream on each worker, each on a keep-alive connection that worker accepted
        # (GatewayProcess.client_on_worker: which worker accepts a fresh connection is the kernel's
        # choice); a worker accepts once its openai pool has loaded (engine_hosts.await_loads).
        streams: list[Stream] = []
        tasks: list[asyncio.Task[None]] = []
        for worker in gw.workers():  # one at a time: each stops the others while it connects
            client = await gw.client_on_worker(worker, headers=auth, timeout=120)
            clients.append(client)
            stream = Stream()
            task = asyncio.create_task(stream.run(client, "/v1/chat/completions", body))
            tasks.append(task)
            first = asyncio.create_task(stream.first.wait())
            await asyncio.wait([task, first], timeout=60, return_when=asyncio.FIRST_COMPLETED)
            if not stream.first.is_set():
                first.cancel()
                if task.done():
                    await task  # raises the worker's refusal
                raise AssertionError(f"worker {worker.pid}: no stream content within 60 s")
            streams.append(stream)
        deadline = time.monotonic() + 30
        while not all(journal_admitted(j) & {s.request_id for s in streams} for j in journals):
            assert time.monotonic() < deadline, "a worker's journal does not hold its stream's admission"
            await asyncio.sleep(0.2)
        short = Stream()
        upstream.script.append(Behaviour(tokens=["a", " b", " c"], token_delay=1.0))  # the next request: ~3 s
        client = httpx.AsyncClient(base_url=gw.base_url, headers=auth, timeout=120)
        clients.append(client)
        tasks.append(asyncio.create_task(short.run(client, "/v1/chat/completions", body)))
        await asyncio.wait_for(short.first.wait(), 60)
        assert not short.done

        assert gw.proc is not None
        gw.proc.send_signal(signal.SIGTERM)  # the master only, as Kubernetes does
        signalled = time.monotonic()
        # readyz and new requests on fresh connections (either worker may take each): 503 from all.
        deadline = signalled + 2.0
        for _ in range(8):
            async with httpx.AsyncClient(base_url=gw.base_url, timeout=10) as probe:
                while (ready := await probe.get("/readyz")).status_code == 200:
                    assert time.monotonic() < deadline, "readyz still 200 two seconds after SIGTERM"
                assert ready.json()["error"]["code"] == "draining"
        oa = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key["key"], max_retries=0)
        try:
            for _ in range(4):
                with pytest.raises(openai.APIStatusError) as refused:
                    await oa.chat.completions.create(model="remote", messages=LONG, max_tokens=2)
                assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
                assert refused.value.response.json()["error"]["code"] == "server_draining"
        finally:
            await oa.close()

        await asyncio.wait_for(asyncio.gather(*tasks), WORKER_DRAIN_SECONDS + 60)
        rc = gw.proc.wait(timeout=60)
        gw.proc = None
        log = gw.log_text()
        assert rc == 0, log[-3000:]
        assert short.done and short.error is None and short.ended_at - signalled < WORKER_DRAIN_SECONDS
        for cut in streams:
            assert cut.error is not None and cut.error["code"] == "server_draining", cut.events[-3:]
            assert cut.ended_at - signalled >= WORKER_DRAIN_SECONDS - 0.5
        assert log.count("SIGTERM: draining") == 2 and log.count("drain: done") == 2, log[-3000:]  # each worker drained

        rows = await ledger_ids(url, key["id"])
        assert set(rows) == {s.request_id for s in [*streams, short]}
        assert rows[short.request_id]["status"] == "completed"
        for cut in streams:
            row = rows[cut.request_id]
            assert row["status"] == "interrupted" and row["finish_reason"] == "cancelled", row
            assert 0 < row["completion_tokens"] < 4000
        counters = await redis_counters(REDIS_URL, prefix, url, key["id"])
        tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows.values())
        assert counters["in_flight"] == 0 and counters["month_tokens"] == tokens, (counters, tokens)
        print(f"\nworkers drain: {len(streams)} long streams over 2 workers cut at "
              f"{max(s.ended_at for s in streams) - signalled:.1f}s, short one done at {short.ended_at - signalled:.1f}s, exit {rc}")
    finally:
        for client in clients:
            await client.aclose()
        gw.stop()
