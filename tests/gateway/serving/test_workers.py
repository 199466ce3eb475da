"""`tollgate serve --workers N`: several server processes on one port, with limits and the ledger
exact across them (shared Redis and Postgres), a journal directory each, /metrics summed over all of
them, and a clear refusal where several processes cannot be exact."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import openai
from openai import AsyncOpenAI

from gateway.cli.main import workers_refused
from gateway.config import EngineSettings, RedisSettings, Settings
from tests.conftest import REDIS_URL, require_redis, run_coro, seconds_to_room_in_minute
from tests.engines.conftest import upstreams  # noqa: F401  (fixture)
from tests.fakes import trtllm
from tests.processes import GatewayProcess

MODELS = """models:
  - id: remote
    backend: openai
    context_length: 4096
    replicas: ["{url}"]
    health_path: null
"""


def _models(tmp_path: Path, text: str) -> str:
    path = tmp_path / f"models-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(text)
    return str(path)


def test_settings_that_cannot_run_as_several_workers_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = _models(tmp_path, MODELS.format(url="http://127.0.0.1:9/v1"))
    local = _models(tmp_path, "models:\n  - id: small\n    backend: hf\n    context_length: 2048\n")
    trtllm.install(monkeypatch)  # the models file's check finds tensorrt_llm
    shared = _models(tmp_path, "models:\n  - id: llama\n    backend: trtllm\n    model_path: /models/llama\n")
    pg, redis = "postgresql://postgres@127.0.0.1:5432/test", "redis://127.0.0.1:6379/0"
    def settings(models_file: str | None, redis_url: str | None, **top: Any) -> Settings:
        return Settings(engines=EngineSettings(models_file=models_file), redis=RedisSettings(url=redis_url), **top)

    assert "remote engines" in str(workers_refused(settings(None, redis, database_url=pg)))
    assert "small" in str(workers_refused(settings(local, redis, database_url=pg)))
    assert "REDIS_URL" in str(workers_refused(settings(remote, None, database_url=pg)))
    assert "Postgres" in str(workers_refused(settings(remote, redis, data_dir=tmp_path)))
    assert workers_refused(settings(remote, redis, database_url=pg)) is None
    assert workers_refused(settings(shared, redis, database_url=pg)) is None  # one engine host for the workers (engines/backends/trtllm_host.py)


def _admin(gw: GatewayProcess) -> httpx.Client:
    return httpx.Client(base_url=gw.base_url, headers={"Authorization": f"Bearer {gw.admin_key}"}, timeout=30)


def _sum_metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def journal_finals(directory: Path) -> set[str]:
    """Request ids of the final rows a worker's ledger journal holds (lines `{"f": row}`)."""
    ids = set()
    for segment in sorted(directory.glob("ledger-*.jsonl")):
        lines = segment.read_bytes().splitlines()
        for i, line in enumerate(lines):
            try:
                entry = json.loads(line)
            except ValueError:
                assert i == len(lines) - 1, f"{segment}: a torn line that is not the last"
                continue  # the worker is still appending (an acknowledgement): not a final row
            if "f" in entry:
                ids.add(entry["f"]["request_id"])
    return ids


def test_two_workers_share_one_rate_limit_and_one_ledger(upstreams: Any, fresh_pg_database: Any, tmp_path: Path) -> None:
    require_redis(REDIS_URL)
    _server, url = upstreams()
    admin_key = "sk-admin-" + uuid.uuid4().hex
    gw = GatewayProcess(
        fresh_pg_database(), tmp_path / "data", admin_key, REDIS_URL=REDIS_URL,
        TOLLGATE_REDIS_PREFIX=f"tgtest:w:{uuid.uuid4().hex[:8]}:", TOLLGATE_WORKERS="2",
        TOLLGATE_MODELS=_models(tmp_path, MODELS.format(url=url)), TOLLGATE_EMBEDDINGS="off",
    ).start()
    try:
        assert gw.proc is not None
        spawned = gw.workers()
        assert len(spawned) == 2  # uvicorn's worker processes
        handed = list(gw.data_dir.glob("worker-settings-*"))  # the Settings the workers read: the secret, the admin key
        assert len(handed) == 1 and handed[0].stat().st_mode & 0o077 == 0, handed
        # Each worker holds its own journal directory.
        deadline = time.monotonic() + 30
        while not ((gw.data_dir / "journal").is_dir() and (gw.data_dir / "journal-1").is_dir()):
            assert time.monotonic() < deadline, list(gw.data_dir.iterdir())
            time.sleep(0.2)

        with _admin(gw) as admin:
            account = admin.post("/admin/accounts", json={"name": "workers"}).json()
            key = admin.post("/admin/keys", json={"account_id": account["id"]}).json()
            assert admin.patch(f"/admin/keys/{key['id']}", json={"limits": {"rpm": 20}}).status_code == 200

        async def fire(n: int) -> list[tuple[int, str]]:
            # One keep-alive connection on each worker (see GatewayProcess.client_on_worker): which
            # worker accepts a fresh one is the kernel's choice, and one took all 20 in two CI runs.
            clients = [await gw.client_on_worker(w, timeout=60, headers={"Authorization": f"Bearer {key['key']}"})
                       for w in spawned]
            try:
                async def one(c: httpx.AsyncClient) -> tuple[int, str]:
                    r = await c.post("/v1/chat/completions", json={"model": "remote", "max_tokens": 8,
                                                                 "messages": [{"role": "user", "content": "hi"}]})
                    return r.status_code, r.headers["x-request-id"]
                # One request on each worker's connection at once, rounds one after another: every
                # round meets the shared limit from both workers together.
                answers: list[tuple[int, str]] = []
                for _ in range(n // 2):
                    answers += await asyncio.gather(*(one(c) for c in clients))
                return answers
            finally:
                for c in clients:
                    await c.aclose()

        time.sleep(seconds_to_room_in_minute(40))  # the 61 requests below in one minute's window
        answers = run_coro(fire(60))
        statuses = [status for status, _ in answers]
        assert statuses.count(200) == 20 and statuses.count(429) == 40, statuses  # one limit for the key, across both
        # Both workers served: each one's journal holds final rows, together exactly the 20 served.
        served_ids = {rid for status, rid in answers if status == 200}
        per_worker = {name: journal_finals(gw.data_dir / name) for name in ("journal", "journal-1")}
        assert all(per_worker.values()), {name: len(ids) for name, ids in per_worker.items()}
        assert per_worker["journal"].isdisjoint(per_worker["journal-1"])
        assert per_worker["journal"] | per_worker["journal-1"] == served_ids

        async def sdk_call() -> Any:
            client = AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key["key"], max_retries=0)
            try:
                return await client.chat.completions.create(model="remote", messages=[{"role": "user", "content": "hi"}])
            finally:
                await client.close()

        with pytest.raises(openai.RateLimitError) as refused:  # the SDK sees the shared limit too
            run_coro(sdk_call())
        assert refused.value.status_code == 429 and refused.value.body["code"] == "rpm"

        with _admin(gw) as admin:
            deadline = time.monotonic() + 30
            while True:  # rows reach the database within the writers' linger
                usage = admin.get("/v1/usage", params={"account_id": account["id"]}).json()
                if usage.get("totals", {}).get("requests") == 20 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert usage["totals"]["requests"] == 20, usage
            # Any worker answers /metrics with the counts of both.
            for _ in range(4):
                text = httpx.get(gw.base_url + "/metrics", timeout=10).text
                assert _sum_metric(text, "tollgate_requests_total", model="remote", status="completed") == 20
                assert _sum_metric(text, "tollgate_quota_rejections_total", limit="rpm") == 41
    finally:
        gw.stop()
    assert not handed[0].exists()  # the server's end takes the secret's copy with it
