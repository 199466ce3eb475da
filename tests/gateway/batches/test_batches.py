"""The Batch API (docs/batches.md) against a real gateway on Postgres with the embedded model, driven
by the official openai and anthropic SDKs: files, batches, their lines' ledger rows at the batch
price, cancel, expiry, and another account's view (404)."""

from __future__ import annotations

import datetime
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from billing.db import create_engine
from tests.conftest import MODEL, Gateway, start_gateway, stop_server, until

PRICE = {"input_per_million": "2.000", "output_per_million": "4.000",
         "batch_input_per_million": "1.000", "batch_output_per_million": "2.000"}
NANOS_IN, NANOS_OUT = 1000, 2000  # the batch price per token, in nano-USD
MAX_FILE = 64 * 1024


@pytest.fixture(scope="module")
def batch_gateway(engine: Any, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    server, gw = start_gateway(fresh_pg_database(migrated=True), engine, tmp_path_factory.mktemp("gw-batches"),
                               batches={"poll_seconds": 0.2, "concurrency": 4, "files_max_bytes": MAX_FILE})
    try:
        yield gw
    finally:
        stop_server(server)


def openai_client(gw: Gateway, key: str) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=gw.v1, api_key=key, max_retries=0, timeout=60)


def chat_lines(n: int, *, max_tokens: int = 2, prefix: str = "req") -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Say the number {i}."}], "max_tokens": max_tokens, "temperature": 0},
    }).encode() + b"\n" for i in range(n))


async def priced(gw: Gateway) -> None:
    async with gw.admin_client() as c:
        r = await c.get("/admin/prices", params={"model": MODEL})
        if not r.json()["data"]:
            r = await c.post("/admin/prices", json={"model": MODEL, **PRICE})
            assert r.status_code == 201, r.text


async def rows_of(gw: Gateway, batch_id: str) -> list[dict[str, Any]]:
    await gw.flush_ledger()
    db = create_engine(gw.db_url)
    try:
        async with db.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT * FROM ledger_entries WHERE batch_id = :b"), {"b": batch_id})).mappings().all()
        return [dict(r) for r in rows]
    finally:
        await db.dispose()


async def ended(client: Any, batch_id: str, timeout: float = 240.0) -> Any:
    got: dict[str, Any] = {}

    async def done() -> bool:
        got["b"] = await client.batches.retrieve(batch_id)
        return got["b"].status in ("completed", "failed", "expired", "cancelled")

    await until(done, f"batch {batch_id} ended", timeout=timeout, every=0.25)
    return got["b"]


async def message_batch_ended(client: Any, batch_id: str, timeout: float = 120.0) -> Any:
    """The Message Batch once its processing_status is `ended` (the anthropic SDK's client)."""
    got: dict[str, Any] = {}

    async def done() -> bool:
        got["b"] = await client.messages.batches.retrieve(batch_id)
        return bool(got["b"].processing_status == "ended")

    await until(done, f"message batch {batch_id} ended", timeout=timeout, every=0.25)
    return got["b"]


async def failed_validation(client: Any, file_id: str, endpoint: str = "/v1/chat/completions") -> Any:
    """The batch an input file that is no batch makes: created, `failed` at once, its one error in
    `errors.data` (OpenAI's BatchError), nothing in it run; the error returned."""
    batch = await client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None and batch.in_progress_at is None, batch
    assert (batch.request_counts.total, batch.output_file_id, batch.error_file_id) == (0, None, None), batch
    again = await client.batches.retrieve(batch.id)
    assert again.status == "failed" and again.errors == batch.errors
    [error] = batch.errors.data
    return error


async def test_fifty_line_batch_completes_at_the_batch_price(batch_gateway: Gateway) -> None:
    gw = batch_gateway
    await priced(gw)
    key = (await gw.new_key())["key"]
    client = openai_client(gw, key)
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(50))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                                        metadata={"job": "fifty"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 50
    batch = await ended(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 50 and batch.request_counts.failed == 0
    assert batch.error_file_id is None and batch.metadata == {"job": "fifty"}
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(batch, stamp) is not None, stamp
    output = (await client.files.content(batch.output_file_id)).content
    lines = [json.loads(x) for x in output.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(f"req-{i}" for i in range(50))
    rows = await rows_of(gw, batch.id)
    assert len(rows) == 50 and len({r["request_id"] for r in rows}) == 50
    by_request = {r["request_id"]: r for r in rows}
    for x in lines:
        response = x["response"]
        assert response["status_code"] == 200 and x["error"] is None
        assert response["body"]["object"] == "chat.completion"
        row = by_request[response["request_id"]]
        assert response["body"]["usage"]["completion_tokens"] == row["completion_tokens"]
    for r in rows:
        assert r["api"] == "batch" and r["status"] == "completed"
        assert r["cost_nanos"] == r["prompt_tokens"] * NANOS_IN + r["completion_tokens"] * NANOS_OUT, r
    # OpenAI's Batch.model and Batch.usage: the batch's model, and the tokens its ledger rows hold.
    batch = await client.batches.retrieve(batch.id)  # rows_of flushed the ledger: every row is there
    prompt, completion = sum(r["prompt_tokens"] for r in rows), sum(r["completion_tokens"] for r in rows)
    assert batch.model == MODEL and batch.usage is not None, batch
    assert (batch.usage.input_tokens, batch.usage.output_tokens, batch.usage.total_tokens) == (prompt, completion, prompt + completion)
    assert batch.usage.input_tokens_details.cached_tokens == sum(r["cached_tokens"] or 0 for r in rows)
    assert [b.usage for b in (await client.batches.list()).data if b.id == batch.id] == [batch.usage]
    import openai

    with pytest.raises(openai.ConflictError) as ended_already:  # OpenAI's 409, not a 400
        await client.batches.cancel(batch.id)
    assert ended_already.value.body["message"] == "Cannot cancel a batch with status 'completed'."  # type: ignore[index]


async def test_anthropic_message_batch_results(batch_gateway: Gateway) -> None:
    from anthropic import AsyncAnthropic

    gw = batch_gateway
    await priced(gw)
    key = (await gw.new_key())["key"]
    client = AsyncAnthropic(base_url=gw.base_url, api_key=key, max_retries=0, timeout=60)
    requests = [{"custom_id": f"m-{i}", "params": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"Hi {i}"}]}}
                for i in range(6)]
    batch = await client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert batch.id.startswith("msgbatch_") and batch.processing_status == "in_progress"
    ended_batch = await message_batch_ended(client, batch.id)
    assert ended_batch.request_counts.succeeded == 6 and ended_batch.results_url
    results = [r async for r in await client.messages.batches.results(batch.id)]
    assert sorted(r.custom_id for r in results) == [f"m-{i}" for i in range(6)]
    for r in results:
        assert r.result.type == "succeeded" and r.result.message.type == "message"  # type: ignore[union-attr]
        assert r.result.message.usage.service_tier == "batch"  # as Anthropic's batch results say  # type: ignore[union-attr]
    rows = await rows_of(gw, batch.id)
    assert len(rows) == 6 and all(r["api"] == "batch" for r in rows)
    assert all(r["cost_nanos"] == r["prompt_tokens"] * NANOS_IN + r["completion_tokens"] * NANOS_OUT for r in rows)
    listed = await client.messages.batches.list()
    assert batch.id in [b.id for b in listed.data]
    # every answer carries Anthropic's request-id, which the SDK reads as `_request_id`
    answers = [batch, ended_batch, listed, await client.messages.batches.with_raw_response.results(batch.id)]
    assert all(getattr(a, "_request_id", None) or getattr(a, "request_id", None) for a in answers), answers
    other = AsyncAnthropic(base_url=gw.base_url, api_key=(await gw.new_key())["key"], max_retries=0)
    from anthropic import NotFoundError

    with pytest.raises(NotFoundError):
        await other.messages.batches.retrieve(batch.id)
    with pytest.raises(NotFoundError):
        await other.messages.batches.results(batch.id)


async def test_a_message_batch_is_bounded_like_a_batch_file_and_checks_each_request_when_it_runs(batch_gateway: Gateway) -> None:
    """A Message Batch carries its requests inline, so its body is bounded like an uploaded batch file
    (TOLLGATE_FILES_MAX_BYTES: 100 MiB by default; here 64 KiB), not like one request's (1 MiB: before,
    a batch of about 1,600 short requests was a 413). As at Anthropic, a request whose params are bad
    (no max_tokens, a model that is no string) is its own `errored` result and the others run; before,
    those two refused the whole batch while any other bad param was per request."""
    from anthropic import APIStatusError, AsyncAnthropic

    gw = batch_gateway
    await priced(gw)
    key = (await gw.new_key())["key"]
    client = AsyncAnthropic(base_url=gw.base_url, api_key=key, max_retries=0, timeout=60)
    words = "word " * 2000
    big = [{"custom_id": f"b-{i}", "params": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": words}]}}
           for i in range(8)]  # about 80 KB: past this gateway's 64 KiB bound
    with pytest.raises(APIStatusError) as too_big:
        await client.messages.batches.create(requests=big)  # type: ignore[arg-type]
    assert too_big.value.status_code == 413 and f"{MAX_FILE}-byte limit" in str(too_big.value)
    assert too_big.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]

    mixed = [{"custom_id": "ok", "params": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}},
             {"custom_id": "no-max", "params": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}},
             {"custom_id": "bad-model", "params": {"model": 5, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}}]
    batch = await client.messages.batches.create(requests=mixed)  # type: ignore[arg-type]
    counts = (await message_batch_ended(client, batch.id)).request_counts
    assert (counts.succeeded, counts.errored) == (1, 2)
    results = {r.custom_id: r.result async for r in await client.messages.batches.results(batch.id)}
    assert results["ok"].type == "succeeded"
    for custom_id in ("no-max", "bad-model"):
        assert results[custom_id].type == "errored", results[custom_id]
        assert results[custom_id].error.error.type == "invalid_request_error"  # type: ignore[union-attr]
    assert len(await rows_of(gw, batch.id)) == 1  # the errored ones were refused before admission: no row


async def test_message_batches_page_both_ways_and_an_ended_one_is_deleted(batch_gateway: Gateway) -> None:
    """The anthropic SDK pages with after_id (older) and, from a before_id, with before_id (newer):
    each page is newest first and the SDK's iteration sees every batch once and ends. An ended batch
    is deleted (`message_batch_deleted`), one still processing is a 400, another account's a 404."""
    from anthropic import AsyncAnthropic, BadRequestError, NotFoundError

    gw = batch_gateway
    client = AsyncAnthropic(base_url=gw.base_url, api_key=(await gw.new_key())["key"], max_retries=0, timeout=60)
    one = [{"custom_id": "x", "params": {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}}]
    made = [(await client.messages.batches.create(requests=one)).id for _ in range(5)]  # type: ignore[arg-type]
    newest_first = made[::-1]

    first = await client.messages.batches.list(limit=2)
    assert [b.id for b in first.data] == newest_first[:2] and first.has_more
    assert [b.id async for b in await client.messages.batches.list(limit=2)] == newest_first  # after_id pages, then ends
    back = await client.messages.batches.list(limit=2, before_id=made[0])
    assert [b.id for b in back.data] == [made[2], made[1]] and back.has_more, back  # just newer than the oldest
    assert (back.first_id, back.last_id) == (made[2], made[1])
    seen = [b.id async for b in await client.messages.batches.list(limit=2, before_id=made[0])]
    assert seen == [made[2], made[1], made[4], made[3]], seen  # before_id pages towards the newest, then ends
    newest = await client.messages.batches.list(limit=2, before_id=made[4])
    assert newest.data == [] and newest.has_more is False

    with pytest.raises(BadRequestError):
        await client.messages.batches.list(after_id=made[1], before_id=made[3])

    for batch_id in made:  # wait for the five to end
        async def ended_(batch_id: str = batch_id) -> bool:
            return (await client.messages.batches.retrieve(batch_id)).processing_status == "ended"

        await until(ended_, "message batch ended", timeout=120, every=0.25)
    rows = await rows_of(gw, made[0])
    other = AsyncAnthropic(base_url=gw.base_url, api_key=(await gw.new_key())["key"], max_retries=0)
    with pytest.raises(NotFoundError):
        await other.messages.batches.delete(made[0])
    deleted = await client.messages.batches.delete(made[0])
    assert (deleted.id, deleted.type) == (made[0], "message_batch_deleted")
    with pytest.raises(NotFoundError):
        await client.messages.batches.retrieve(made[0])
    with pytest.raises(NotFoundError):
        await client.messages.batches.delete(made[0])
    assert [b.id async for b in await client.messages.batches.list(limit=2)] == newest_first[:4]
    assert len(rows) == 1 and await rows_of(gw, made[0]) == rows  # billed is billed: its ledger row stays

    running = await client.messages.batches.create(requests=[  # type: ignore[arg-type]
        {"custom_id": f"r{i}", "params": {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Count."}]}}
        for i in range(40)])
    with pytest.raises(BadRequestError) as refused:
        await client.messages.batches.delete(running.id)
    assert "cancel" in refused.value.message and refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    await client.messages.batches.cancel(running.id)


async def test_files_list_in_either_order_and_pages_through_every_file_once(batch_gateway: Gateway) -> None:
    """GET /v1/files takes OpenAI's `order` (asc | desc, newest first by default) and pages with
    `after` in that order; `order=asc` was ignored (newest first, and `after` the oldest gave older)."""
    import openai

    gw = batch_gateway
    client = openai_client(gw, (await gw.new_key())["key"])
    made = [(await client.files.create(file=(f"f{i}.jsonl", io.BytesIO(chat_lines(1))), purpose="batch")).id for i in range(5)]
    assert [f.id async for f in await client.files.list(order="asc", limit=2)] == made  # every page, then the end
    assert [f.id async for f in await client.files.list(order="desc", limit=2)] == made[::-1]
    assert [f.id for f in (await client.files.list()).data] == made[::-1]
    after = await client.files.list(order="asc", after=made[1], limit=2)
    assert [f.id for f in after.data] == made[2:4] and after.has_more
    with pytest.raises(openai.BadRequestError) as refused:
        await client.files.list(extra_query={"order": "sideways"})
    assert refused.value.body["param"] == "order"  # type: ignore[index]


async def test_cancel_stops_claiming_lines(batch_gateway: Gateway) -> None:
    gw = batch_gateway
    key = (await gw.new_key())["key"]
    client = openai_client(gw, key)
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(40, max_tokens=8))), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = await ended(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None and batch.cancelling_at is not None
    errors = [json.loads(x) for x in (await client.files.content(batch.error_file_id)).content.splitlines()]
    cancelled = [e for e in errors if e["error"] and e["error"]["code"] == "batch_cancelled"]
    assert cancelled and all(e["response"] is None for e in cancelled)
    ran = batch.request_counts.completed + len(errors) - len(cancelled)
    assert ran < 40, batch.request_counts
    rows = await rows_of(gw, batch.id)
    assert len(rows) == ran  # no line that was cancelled ran
    # As at OpenAI, a line never run is in the error file (batch_cancelled) but in neither count:
    # `failed` is the lines that ran without a 2xx answer, total - completed - failed those never run.
    counts = batch.request_counts
    assert counts.failed == len(errors) - len(cancelled) and counts.total == 40, counts
    assert counts.total - counts.completed - counts.failed == len(cancelled), counts
    assert (await client.batches.retrieve(batch.id)).status == "cancelled"


async def test_another_account_cannot_see_files_or_batches(batch_gateway: Gateway) -> None:
    from openai import NotFoundError

    gw = batch_gateway
    owner = openai_client(gw, (await gw.new_key())["key"])
    other = openai_client(gw, (await gw.new_key())["key"])
    uploaded = await owner.files.create(file=("in.jsonl", io.BytesIO(chat_lines(1))), purpose="batch")
    batch = await owner.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: other.files.retrieve(uploaded.id), lambda: other.files.content(uploaded.id),
                 lambda: other.files.delete(uploaded.id), lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id),
                 lambda: other.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")):
        with pytest.raises(NotFoundError):
            await call()
    assert uploaded.id not in [f.id for f in (await other.files.list()).data]
    assert batch.id not in [b.id for b in (await other.batches.list()).data]
    assert batch.id in [b.id for b in (await owner.batches.list()).data]
    assert (await owner.files.retrieve(uploaded.id)).id == uploaded.id
    await ended(owner, batch.id)


async def test_bad_input_is_refused_in_openai_shape(batch_gateway: Gateway) -> None:
    import openai

    gw = batch_gateway
    key = (await gw.new_key())["key"]
    client = openai_client(gw, key)

    async def refused(status: type[Exception], call: Any, param: str | None = None, code: str | None = None) -> None:
        with pytest.raises(status) as caught:
            await call
        body = caught.value.body  # type: ignore[attr-defined]
        assert set(body) >= {"message", "type", "param", "code"}, body
        if param is not None:
            assert body["param"] == param, body
        if code is not None:
            assert body["code"] == code, body

    good = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(2))), purpose="batch")
    await refused(openai.NotFoundError, client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                                                              completion_window="24h"))
    await refused(openai.BadRequestError, client.batches.create(input_file_id=good.id, endpoint="/v1/images/generations",  # type: ignore[arg-type]
                                                                completion_window="24h"), "endpoint")
    await refused(openai.BadRequestError, client.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions",
                                                                completion_window="48h"), "completion_window")  # type: ignore[arg-type]
    await refused(openai.BadRequestError, client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune"),
                  "purpose", "invalid_purpose")
    await refused(openai.APIStatusError, client.files.create(file=("big.jsonl", io.BytesIO(b"x" * (MAX_FILE + 1))), purpose="batch"),
                  "file")
    async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {key}"}) as raw:
        r = await raw.post("/v1/files", files={"file": ("big.jsonl", b"x" * (MAX_FILE + 1))}, data={"purpose": "batch"})
        assert r.status_code == 413, r.text
    # A batch's output file has purpose batch_output: it is no batch input.
    batch = await ended(client, (await client.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions",
                                                             completion_window="24h")).id)
    await refused(openai.BadRequestError, client.batches.create(input_file_id=batch.output_file_id, endpoint="/v1/chat/completions",
                                                                completion_window="24h"), "input_file_id", "invalid_purpose")
    assert (await client.files.delete(good.id)).deleted
    await refused(openai.NotFoundError, client.files.retrieve(good.id))


async def test_metadata_takes_openais_bounds_and_a_refusal_names_the_one_passed(batch_gateway: Gateway) -> None:
    """OpenAI's Metadata: 16 pairs, keys up to 64 characters, values up to 512 (strings). At the
    bounds a batch is made and its metadata read back whole; past one, a 400 on `metadata` whose
    message names that bound (one message, "at most 16 string values", answered them all)."""
    import openai

    gw = batch_gateway
    client = openai_client(gw, (await gw.new_key())["key"])
    good = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(1))), purpose="batch")
    fullest = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    batch = await client.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions", completion_window="24h", metadata=fullest)
    assert batch.metadata == fullest and (await client.batches.retrieve(batch.id)).metadata == fullest
    for metadata, says in (({f"k{i}": "v" for i in range(17)}, "17 pairs; at most 16"),
                           ({"k" * 65: "v"}, "65 characters; at most 64"),
                           ({"k": "v" * 513}, "513 characters; at most 512"),
                           ({"k": 5}, "must be a string")):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions", completion_window="24h",
                                        metadata=metadata)  # type: ignore[arg-type]
        body = refused.value.body  # type: ignore[attr-defined]
        assert body["param"] == "metadata" and says in body["message"], (says, body)
    await ended(client, batch.id)


async def test_an_input_file_that_is_no_batch_makes_a_failed_batch_naming_the_line(batch_gateway: Gateway) -> None:
    """As OpenAI: batches.create answers a Batch, which fails its validation (`failed`, `failed_at`)
    with the reason in `errors.data` (code, line, message, param) rather than a 400; nothing runs."""
    gw = batch_gateway
    key = await gw.new_key()
    client = openai_client(gw, key["key"])
    one = chat_lines(1).decode()
    other_model = one.replace(f'"model": "{MODEL}"', '"model": "another-model"').replace("req-0", "other")
    cases = [
        (chat_lines(2) + b"{not json\n", "/v1/chat/completions", ("invalid_json_line", 3, None)),
        (chat_lines(2) + chat_lines(1), "/v1/chat/completions", ("duplicate_custom_id", 3, "custom_id")),
        (chat_lines(2), "/v1/completions", ("url_mismatch", 1, "url")),
        ((one + other_model).encode(), "/v1/chat/completions", ("model_mismatch", 2, "body.model")),
        (b"\n\n", "/v1/chat/completions", ("empty_file", None, None)),
        (chat_lines(2).replace(b'"model": ', b'"modle": ', 1), "/v1/chat/completions", ("invalid_request", 1, "body.model")),
        # OpenAI fails a line without its method ("missing required 'method'"); it was run as a POST here.
        (chat_lines(2).replace(b'"method": "POST", ', b'', 1), "/v1/chat/completions", ("invalid_request", 1, "method")),
    ]
    for content, endpoint, expected in cases:
        uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        error = await failed_validation(client, uploaded.id, endpoint)
        assert (error.code, error.line, error.param) == expected, (expected, error)
        assert error.message
    await gw.flush_ledger()
    assert await gw.ledger_count(key_id=key["id"]) == 0


async def test_files_expire_as_their_expires_after_says(batch_gateway: Gateway) -> None:
    """OpenAI's expires_after on an upload and output_expires_after on a batch: the File object's
    expires_at, 400s outside 1 hour to 30 days, and once it has passed the file is gone (no read
    finds it; the runner's next round deletes its row)."""
    import openai

    gw = batch_gateway
    client = openai_client(gw, (await gw.new_key())["key"])
    kept = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(1))), purpose="batch")
    # None asked: 30 days, as OpenAI's batch files ("By default, files with purpose=batch expire after 30 days")
    assert kept.expires_at == kept.created_at + 30 * 24 * 3600 and (await client.files.retrieve(kept.id)).expires_at == kept.expires_at
    hour = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(2))), purpose="batch",
                                     expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at == hour.created_at + 3600 and (await client.files.retrieve(hour.id)).expires_at == hour.expires_at
    for bad, param in (({"anchor": "created_at", "seconds": 5}, "expires_after.seconds"),
                       ({"anchor": "created_at", "seconds": 2_592_001}, "expires_after.seconds"),
                       ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor")):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(1))), purpose="batch", expires_after=bad)  # type: ignore[arg-type]
        assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.batches.create(input_file_id=hour.id, endpoint="/v1/chat/completions", completion_window="24h",
                                    output_expires_after={"anchor": "created_at", "seconds": 60})
    assert refused.value.body["param"] == "output_expires_after.seconds"  # type: ignore[index]

    batch = await client.batches.create(input_file_id=hour.id, endpoint="/v1/chat/completions", completion_window="24h",
                                        output_expires_after={"anchor": "created_at", "seconds": 7200})
    batch = await ended(client, batch.id)
    output = await client.files.retrieve(batch.output_file_id)
    assert output.expires_at == output.created_at + 7200, output

    db = create_engine(gw.db_url)
    try:
        async with db.begin() as conn:  # an hour later, as far as the files know
            await conn.execute(sa.text("UPDATE stored_files SET expires_at = :t WHERE id IN (:a, :b)"),
                               {"t": datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1), "a": hour.id, "b": output.id})
        for gone in (hour.id, output.id):
            for read in (client.files.retrieve, client.files.content, client.files.delete):
                with pytest.raises(openai.NotFoundError):
                    await read(gone)
        listed = [f.id async for f in client.files.list()]
        assert kept.id in listed and hour.id not in listed and output.id not in listed

        async def deleted() -> bool:
            async with db.connect() as conn:
                return not (await conn.execute(sa.text("SELECT count(*) FROM stored_files WHERE id IN (:a, :b)"),
                                               {"a": hour.id, "b": output.id})).scalar()

        await until(deleted, "the runner deleted the expired files", timeout=30)
    finally:
        await db.dispose()
    assert (await client.files.retrieve(kept.id)).id == kept.id


@pytest.fixture(scope="module")
def short_window_gateway(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """On SQLite (the embedded default), every batch's window 4 s long."""
    tmp = tmp_path_factory.mktemp("gw-batches-sqlite")
    server, gw = start_gateway(f"sqlite:///{tmp / 'tollgate.db'}", engine, tmp,
                               batches={"poll_seconds": 0.2, "concurrency": 2, "window_seconds": 4.0})
    try:
        yield gw
    finally:
        stop_server(server)


async def test_a_batch_its_quota_stops_expires_with_the_rest_in_the_error_file(short_window_gateway: Gateway) -> None:
    gw = short_window_gateway
    limit = 120  # tokens this month: a few lines' worth (each reserves its prompt + max_tokens)
    key = await gw.new_key()
    async with gw.admin_client() as c:
        assert (await c.patch(f"/admin/keys/{key['id']}", json={"limits": {"monthly_tokens": limit}})).status_code == 200
    client = openai_client(gw, key["key"])
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(30, max_tokens=4))), purpose="batch")
    started = time.monotonic()
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.expires_at - batch.created_at == 4  # the window it runs under, not completion_window's 24 h
    batch = await ended(client, batch.id, timeout=60)
    assert batch.status == "expired" and batch.expired_at is not None, batch
    assert time.monotonic() - started >= 3.5  # it waited for its window, retrying the refused lines
    ran = batch.request_counts.completed
    errors = [json.loads(x) for x in (await client.files.content(batch.error_file_id)).content.splitlines()]
    expired = [e["custom_id"] for e in errors if e["error"] and e["error"]["code"] == "batch_expired"]
    assert expired and ran + len(expired) == 30, (ran, len(expired), errors[:2])
    # OpenAI's counts for an expired batch: the lines never run are in the error file, not in `failed`
    # (a real one read {total: 10, completed: 1, failed: 0} with 9 batch_expired lines: warmbly PR #333).
    counts = batch.request_counts
    assert (counts.total, counts.failed) == (30, len(errors) - len(expired)), counts
    assert counts.total - counts.completed - counts.failed == len(expired), counts
    output = [json.loads(x) for x in (await client.files.content(batch.output_file_id)).content.splitlines()] if ran else []
    assert sorted([*expired, *(x["custom_id"] for x in output)]) == sorted(f"req-{i}" for i in range(30))
    rows = await rows_of(gw, batch.id)
    assert len(rows) == ran  # a line refused by the quota has no row; one that ran has one
    assert sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows) <= limit  # its lines counted against the quota


def lines_for(endpoint: str, bodies: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps({"custom_id": f"c-{i}", "method": "POST", "url": endpoint, "body": b}).encode() + b"\n"
                    for i, b in enumerate(bodies))


@pytest.mark.parametrize("endpoint, bodies, shape", [
    # One model a file (OpenAI's rule); the second line is one its route refuses (400).
    ("/v1/completions", [{"model": MODEL, "prompt": "One two", "max_tokens": 2}, {"model": MODEL, "prompt": "x", "max_tokens": -1}],
     "text_completion"),
    ("/v1/responses", [{"model": MODEL, "input": "Hi", "max_output_tokens": 16}, {"model": MODEL, "input": "x", "max_output_tokens": -1}],
     "response"),
    ("/v1/embeddings", [{"model": "all-minilm-l6-v2", "input": "a sentence"}, {"model": "all-minilm-l6-v2", "input": ""}], "list"),
])
async def test_every_endpoint_runs_in_a_batch(batch_gateway: Gateway, endpoint: str, bodies: list[dict[str, Any]], shape: str) -> None:
    gw = batch_gateway
    key = (await gw.new_key())["key"]
    client = openai_client(gw, key)
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(lines_for(endpoint, bodies))), purpose="batch")
    batch = await ended(client, (await client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,  # type: ignore[arg-type]
                                                             completion_window="24h")).id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (1, 1), batch
    [ok] = [json.loads(x) for x in (await client.files.content(batch.output_file_id)).content.splitlines()]
    [bad] = [json.loads(x) for x in (await client.files.content(batch.error_file_id)).content.splitlines()]
    assert ok["custom_id"] == "c-0" and ok["response"]["body"]["object"] == shape
    assert bad["custom_id"] == "c-1" and bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["message"]
    rows = await rows_of(gw, batch.id)  # the refused line has no row: it was never admitted
    assert [(r["request_id"], r["api"]) for r in rows] == [(ok["response"]["request_id"], "batch")]


async def test_a_draining_server_claims_no_more_lines_and_lets_go_of_the_batch(batch_gateway: Gateway) -> None:
    gw = batch_gateway
    client = openai_client(gw, (await gw.new_key())["key"])
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(20, max_tokens=8))), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    runner = gw.app.state.batch_runner
    await until(lambda: batch.id in runner._jobs, "the runner took the batch", timeout=30)
    gw.app.draining = True  # what SIGTERM sets (gateway/http/drain.py)
    try:
        await until(lambda: batch.id not in runner._jobs, "the runner let the batch go", timeout=120)
        db = create_engine(gw.db_url)
        try:
            async with db.connect() as conn:
                row = (await conn.execute(sa.text("SELECT lease_until, status FROM batches WHERE id = :b"), {"b": batch.id})).one()
                states = dict((await conn.execute(sa.text(
                    "SELECT state, count(*) FROM batch_lines WHERE batch_id = :b GROUP BY state"), {"b": batch.id})).all())
        finally:
            await db.dispose()
        assert states.get("claimed", 0) == 0 and states.get("pending", 0) > 0, states  # in flight finished; the rest wait
        lease_until = row.lease_until if row.lease_until.tzinfo else row.lease_until.replace(tzinfo=datetime.timezone.utc)
        assert lease_until <= datetime.datetime.now(datetime.timezone.utc)  # another process may take it at once
        assert row.status == "in_progress"
    finally:
        gw.app.draining = False
    runner.wake()
    assert (await ended(client, batch.id)).status == "completed"
    assert len(await rows_of(gw, batch.id)) == 20


async def test_a_failed_round_of_the_runner_is_reported_and_the_next_ones_run(batch_gateway: Gateway) -> None:
    gw = batch_gateway
    runner = gw.app.state.batch_runner
    store, failures = runner._store, runner.loop.pulse.failures

    async def broken_once() -> Any:
        del store.active  # the store's own method again
        raise ConnectionRefusedError("the database is down")

    store.active = broken_once
    await until(lambda: runner.loop.pulse.failures == failures + 1, "the failed round reported")
    assert isinstance(runner.loop.pulse.last_error, ConnectionRefusedError)
    client = openai_client(gw, (await gw.new_key())["key"])
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(3))), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert (await ended(client, batch.id)).status == "completed"
    assert runner.loop.alive


def openai_error(r: httpx.Response, param: str) -> dict[str, Any]:
    """A 400 in OpenAI's shape that names `param`."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    assert error["param"] == param, error
    return dict(error)


async def test_an_unhashable_completion_window_is_a_400_naming_it(batch_gateway: Gateway) -> None:
    gw = batch_gateway
    key = (await gw.new_key())["key"]
    client = openai_client(gw, key)
    good = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(1))), purpose="batch")
    async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {key}"}) as raw:
        for window in ([], {}, ["24h"], {"24h": 1}):
            r = await raw.post("/v1/batches", json={"input_file_id": good.id, "endpoint": "/v1/chat/completions",
                                                    "completion_window": window})
            assert "completion_window" in openai_error(r, "completion_window")["message"]
    batch = await client.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert (await ended(client, batch.id)).status == "completed"  # the server still serves


async def test_a_limit_of_unicode_digits_is_a_400_in_each_api(batch_gateway: Gateway) -> None:
    gw = batch_gateway
    key = (await gw.new_key())["key"]
    async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {key}"}) as raw:
        for path in ("/v1/batches", "/v1/files", "/v1/responses/resp_none/input_items"):  # the limit is checked first
            for limit in ("²", "١٢", "𝟓", "9" * 5000):  # str.isdigit() holds for each; int() refuses '²' and 5,000 digits
                openai_error(await raw.get(path, params={"limit": limit}), "limit")
            assert (await raw.get(path, params={"limit": "2"})).status_code == (404 if "responses" in path else 200)
    async with httpx.AsyncClient(base_url=gw.base_url, headers={"x-api-key": key, "anthropic-version": "2023-06-01"}) as raw:
        for limit in ("²", "³", "9" * 5000):
            r = await raw.get("/v1/messages/batches", params={"limit": limit})
            assert r.status_code == 400, r.text
            body = r.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            assert "limit" in body["error"]["message"], body
        assert (await raw.get("/v1/messages/batches", params={"limit": "2"})).status_code == 200


async def test_an_input_line_nested_too_deep_is_refused_with_its_line_number(batch_gateway: Gateway) -> None:
    """A line's body is written again (orjson.dumps, 255 levels at most): one nested deeper than the
    gateway takes was a 500 at batch creation; it is a 400 naming its line."""

    from gateway.http.requests import MAX_JSON_DEPTH

    gw = batch_gateway
    client = openai_client(gw, (await gw.new_key())["key"])
    deep = '{"x":' * 300 + '"deep"' + "}" * 300
    line = ('{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "%s", '
            '"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "extra": %s}}' % (MODEL, deep)).encode()
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(1) + line + b"\n")), purpose="batch")
    error = await failed_validation(client, uploaded.id)
    assert (error.code, error.line, error.message) == ("invalid_json_line", 2, f"nested more than {MAX_JSON_DEPTH} levels deep")


async def test_a_nul_in_an_input_line_is_refused_with_its_line_number(batch_gateway: Gateway) -> None:

    gw = batch_gateway
    client = openai_client(gw, (await gw.new_key())["key"])

    def line(custom_id: str, content: str) -> bytes:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}}).encode() + b"\n"

    for custom_id in ("a\u0000b", "\u0000"):  # a text column (custom_id) cannot hold a NUL
        bad = line(custom_id, "Hi")
        assert b"\\u0000" in bad
        uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(2) + bad)), purpose="batch")
        error = await failed_validation(client, uploaded.id)
        assert (error.line, error.param) == (3, "custom_id") and "NUL" in error.message, error
    # the model is kept in a text column too (the batch's model): a failed batch naming it, not a 500
    nul_model = json.dumps({"custom_id": "m", "method": "POST", "url": "/v1/chat/completions",
                            "body": {"model": MODEL + "\u0000", "messages": [{"role": "user", "content": "Hi"}]}}).encode() + b"\n"
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(nul_model)), purpose="batch")
    error = await failed_validation(client, uploaded.id)
    assert (error.line, error.param) == (1, "body.model") and "NUL" in error.message, error
    # A NUL in a line's body is stored escaped (the body is JSON text): the line runs and its route
    # refuses it as it refuses any request body with one, a 400 in the error file.
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(1) + line("nul", "H\u0000i"))), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = await ended(client, batch.id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (1, 1), batch
    [bad_line] = [json.loads(x) for x in (await client.files.content(batch.error_file_id)).content.splitlines()]
    assert bad_line["custom_id"] == "nul" and bad_line["response"]["status_code"] == 400, bad_line
    assert "NUL" in bad_line["response"]["body"]["error"]["message"], bad_line


async def test_line_separators_inside_json_strings_do_not_split_lines(batch_gateway: Gateway) -> None:

    gw = batch_gateway
    client = openai_client(gw, (await gw.new_key())["key"])
    texts = ["one\u2028two", "three\u2029four", "five\u0085six"]  # unescaped with ensure_ascii=False: legal JSON
    content = "".join(json.dumps({"custom_id": f"s-{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": MODEL, "messages": [{"role": "user", "content": t}], "max_tokens": 2}},
                                 ensure_ascii=False) + ("\r\n" if i % 2 else "\n") for i, t in enumerate(texts)).encode()
    assert "\u2028".encode() in content and "\u0085".encode() in content
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.request_counts.total == 3
    batch = await ended(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    output = [json.loads(x) for x in (await client.files.content(batch.output_file_id)).content.split(b"\n") if x]
    assert sorted(x["custom_id"] for x in output) == ["s-0", "s-1", "s-2"]
    # A bad line after them is named by its own number.
    broken = await client.files.create(file=("in.jsonl", io.BytesIO(content + b"{not json\n")), purpose="batch")
    error = await failed_validation(client, broken.id)
    assert (error.code, error.line) == ("invalid_json_line", 4), error


async def test_a_streaming_line_with_stream_options_is_answered_in_one_body(batch_gateway: Gateway) -> None:
    gw = batch_gateway
    client = openai_client(gw, (await gw.new_key())["key"])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    uploaded = await client.files.create(file=("in.jsonl", io.BytesIO(lines_for("/v1/chat/completions", [body]))), purpose="batch")
    batch = await ended(client, (await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                             completion_window="24h")).id)
    errors = (await client.files.content(batch.error_file_id)).content if batch.error_file_id else b""
    assert batch.status == "completed" and batch.request_counts.completed == 1, (batch, errors)
    [ok] = [json.loads(x) for x in (await client.files.content(batch.output_file_id)).content.splitlines()]
    assert ok["response"]["status_code"] == 200 and ok["response"]["body"]["object"] == "chat.completion", ok
    assert ok["response"]["body"]["usage"]["completion_tokens"] >= 1


OPENAI_NOT_FOUND = {"batch": ("batch_id", "batch_not_found"), "file": ("id", "file_not_found")}


@pytest.mark.parametrize("method, path, params, expect", [
    ("GET", "/v1/batches/a%00b", {}, "batch"),
    ("POST", "/v1/batches/a%00b/cancel", {}, "batch"),
    ("GET", "/v1/files/a%00b", {}, "file"),
    ("GET", "/v1/files/a%00b/content", {}, "file"),
    ("DELETE", "/v1/files/a%00b", {}, "file"),
    ("GET", "/v1/batches", {"after": "a\x00b"}, "as_unknown"),
    ("GET", "/v1/files", {"after": "a\x00b"}, "as_unknown"),
    ("GET", "/v1/files", {"purpose": "a\x00b"}, "as_unknown"),
    ("GET", "/v1/messages/batches/a%00b", {}, "anthropic"),
    ("GET", "/v1/messages/batches/a%00b/results", {}, "anthropic"),
    ("POST", "/v1/messages/batches/a%00b/cancel", {}, "anthropic"),
    ("GET", "/v1/messages/batches", {"after_id": "a\x00b"}, "as_unknown"),
    ("GET", "/v1/messages/batches", {"before_id": "a\x00b"}, "as_unknown"),
])
async def test_a_nul_in_an_id_or_cursor_is_answered_as_an_unknown_one(batch_gateway: Gateway, method: str, path: str,
                                                                       params: dict[str, str], expect: str) -> None:
    """Postgres refuses a NUL in a text parameter: such an id matches nothing (404 in the API's shape),
    such a cursor or filter answers as an unknown one does, and the server goes on serving."""
    gw = batch_gateway
    key = (await gw.new_key())["key"]
    client = openai_client(gw, key)
    own = await client.files.create(file=("in.jsonl", io.BytesIO(chat_lines(1))), purpose="batch")  # a page to skip past
    anthropic = path.startswith("/v1/messages/")
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"} if anthropic else {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=gw.base_url, headers=headers, timeout=30) as raw:
        r = await raw.request(method, path, params=params)
        if expect == "as_unknown":  # the same answer as for a cursor or filter naming nothing
            unknown = await raw.request(method, path, params={k: "nope" for k in params})
            assert (r.status_code, r.json()) == (unknown.status_code, unknown.json()), r.text
            assert r.status_code == 200 and r.json()["data"] == [], r.text
        elif expect == "anthropic":
            assert r.status_code == 404, r.text
            body = r.json()
            assert body["type"] == "error" and body["error"]["type"] == "not_found_error", body
            assert isinstance(body["error"]["message"], str), body
        else:
            assert r.status_code == 404, r.text
            error = r.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
            assert (error["param"], error["code"]) == OPENAI_NOT_FOUND[expect], error
    # The server still serves, on this connection pool and with the database.
    assert (await client.files.retrieve(own.id)).id == own.id
    assert own.id in [f.id for f in (await client.files.list(purpose="batch")).data]


def test_an_embeddings_batch_holds_at_most_50000_inputs() -> None:
    """OpenAI's Batches API reference: "/v1/embeddings batches are also restricted to a maximum of
    50,000 embedding inputs across all requests in the batch". A list counts its items; one string or
    one token array counts one. Past the limit the file makes a failed batch naming the line."""
    from gateway.batches.results import BadInput, parse_input

    def line(i: int, given: Any) -> bytes:
        return json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": given}}).encode()

    full = [line(i, ["text"] * 2000) for i in range(24)] + [line(24, ["text"] * 1998), line(25, "one"), line(26, [5, 6, 7])]
    assert len(parse_input(b"\n".join(full), "/v1/embeddings", 50_000)[0]) == 27  # 50,000 inputs exactly
    with pytest.raises(BadInput) as past:
        parse_input(b"\n".join([*full, line(27, ["one more"])]), "/v1/embeddings", 50_000)
    assert (past.value.line, past.value.param) == (28, "body.input") and "50000" in past.value.message
    assert len(parse_input(b"\n".join([line(i, ["t"] * 2048) for i in range(30)]).replace(b"/v1/embeddings", b"/v1/chat/completions"),
                           "/v1/chat/completions", 50_000)[0]) == 30  # the limit is the embeddings endpoint's
