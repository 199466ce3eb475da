"""A gateway SIGKILLed in the middle of a batch and started again on the same database and data
directory finishes the batch: every line once in the output or error file, one ledger row per line,
none twice (docs/batches.md: how a restart judges the lines the killed run had claimed)."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from billing.db import create_engine
from tests.conftest import SECRET, bootstrap
from tests.gateway.batches.test_batches import chat_lines
from tests.processes import GatewayProcess

LINES = 50


async def _rows(url: str, batch_id: str) -> list[dict[str, Any]]:
    db = create_engine(url)
    try:
        async with db.connect() as conn:
            return [dict(r) for r in (await conn.execute(
                sa.text("SELECT request_id, status FROM ledger_entries WHERE batch_id = :b"), {"b": batch_id})).mappings().all()]
    finally:
        await db.dispose()


async def test_a_batch_survives_a_sigkill(fresh_pg_database: Any, tmp_path: Path) -> None:
    from openai import AsyncOpenAI

    url = fresh_pg_database(migrated=True)
    admin_key = bootstrap(url, SECRET)
    env = {"TOLLGATE_BATCH_POLL_SECONDS": "0.2", "TOLLGATE_BATCH_CONCURRENCY": "4", "TOLLGATE_BATCH_LEASE_SECONDS": "3", "TOLLGATE_EMBEDDINGS": "off"}
    gw = GatewayProcess(url, tmp_path / "data", admin_key, **env).start()
    try:
        key = (await gw.new_key())["key"]
        client = AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=60)
        uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(LINES, max_tokens=3))), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 180
        while len(await _rows(url, batch.id)) < 10:  # well under way: lines done, others in flight
            assert time.monotonic() < deadline, "the batch did not get under way"
            await asyncio.sleep(0.1)
        await client.close()
        gw.kill()  # SIGKILL: no drain, no flush
        before = {r["request_id"] for r in await _rows(url, batch.id)}
        assert len(before) < LINES, "the batch had finished before the kill; nothing was tested"
        gw.start()
        client = AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=60)
        deadline = time.monotonic() + 240
        while (batch := await client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"the batch did not finish after the restart: {batch.request_counts}"
            await asyncio.sleep(0.25)
        assert batch.status == "completed", batch
        rows = await _rows(url, batch.id)
        ids = [r["request_id"] for r in rows]
        assert len(ids) == LINES and len(set(ids)) == LINES, f"{len(ids)} rows for {len(set(ids))} lines"
        assert set(ids) == {f"{batch.id}-{i}" for i in range(LINES)}
        files = [batch.output_file_id, batch.error_file_id]
        lines = [json.loads(x) for f in files if f for x in (await client.files.content(f)).content.splitlines()]
        assert sorted(x["custom_id"] for x in lines) == sorted(f"req-{i}" for i in range(LINES))
        interrupted = [x for x in lines if x["response"]["status_code"] != 200]
        assert all(x["response"]["body"]["error"]["code"] in ("interrupted", "answer_lost") for x in interrupted)
        assert batch.request_counts.completed + batch.request_counts.failed == LINES
        by_status = {r["request_id"]: r["status"] for r in rows}
        for x in interrupted:  # a line the kill cut short is not run again: its one row says how far it got
            status = by_status[x["response"]["request_id"]]
            assert (x["response"]["body"]["error"]["code"], status) in (("interrupted", "interrupted"), ("answer_lost", "completed")), (x, status)
        print(f"restart: {len(before)} rows before the kill, {len(interrupted)} lines interrupted by it")
        await client.close()
    finally:
        gw.stop()
