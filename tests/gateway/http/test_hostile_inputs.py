"""Hostile clients get a clear 4xx and the server keeps serving: oversized bodies and headers,
slowloris (slow headers, slow bodies, idle sockets), invalid UTF-8, deeply nested JSON, repeated
query parameters, huge max_tokens, bad admin limits and ids, path traversal in invoice downloads."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL, Gateway, start_gateway

READ_TIMEOUT = 1.5
MAX_HEADER_BYTES = 16 * 1024
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def hostile_gw(engine: Any, fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    server, gw = start_gateway(
        fresh_pg_database(migrated=True), engine, tmp_path_factory.mktemp("gw-hostile"),
        http={"request_read_timeout": READ_TIMEOUT, "max_header_bytes": MAX_HEADER_BYTES, "max_body_bytes": 64 * 1024},
    )
    try:
        yield gw
    finally:
        server.__exit__()


@pytest.fixture(scope="module")
def customer_key(hostile_gw: Gateway) -> dict[str, Any]:
    from tests.conftest import run_coro

    return run_coro(hostile_gw.new_key())  # type: ignore[no-any-return]


@pytest.fixture
async def client(hostile_gw: Gateway, customer_key: dict[str, Any]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=hostile_gw.base_url, headers={"Authorization": f"Bearer {customer_key['key']}"}, timeout=30) as c:
        yield c


async def still_serving(gw: Gateway, key: str) -> None:
    async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        assert (await c.get("/healthz")).status_code == 200
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text


def clear_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code, err
    return err  # type: ignore[no-any-return]


async def read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (kept even if a later write of ours failed)."""
    data = b""
    try:
        while chunk := await reader.read(65536):
            data += chunk
    except (ConnectionError, OSError):
        pass
    return data


async def raw(gw: Gateway, payload: bytes, *, wait: float = 10.0) -> bytes:
    host, port = gw.base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    answer = asyncio.create_task(read_all(reader))
    try:
        writer.write(payload)
        await writer.drain()
    except (ConnectionError, OSError):
        pass  # the server answered and closed before we finished sending
    try:
        return await asyncio.wait_for(answer, wait)
    finally:
        writer.close()


async def test_oversized_bodies_are_413(client: httpx.AsyncClient, hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 200_000}]}
    clear_error(await client.post("/v1/chat/completions", json=big), 413, "payload_too_large")

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted while it streams in
        for _ in range(100):
            yield b" " * 4096

    clear_error(await client.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}), 413)
    async with hostile_gw.admin_client() as a:
        clear_error(await a.post("/admin/accounts", content=b"{" + b" " * 100_000 + b"}"), 413)
    await still_serving(hostile_gw, customer_key["key"])


async def test_oversized_headers_are_431(hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    one_big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 10) + b"\r\n\r\n"
    many = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 100) for i in range(300)) + b"\r\n"
    for payload in (one_big, many):
        answer = await raw(hostile_gw, payload)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"
    await still_serving(hostile_gw, customer_key["key"])


async def test_a_malformed_request_is_a_400_in_the_apis_shape(hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    """What the HTTP parser refuses (a Content-Length beside chunked, two lengths, a negative one) is
    a 400 in the API's error shape, Anthropic's on its routes, and the server keeps serving. Before,
    uvicorn's plain-text "Invalid HTTP request received." (an audit)."""
    framings = [b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", b"Content-Length: 5\r\nContent-Length: 7\r\n",
                b"Content-Length: -1\r\n"]
    for framing in framings:
        answer = await raw(hostile_gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n{}")
        assert answer.startswith(b"HTTP/1.1 400 ") and b"application/json" in answer.split(b"\r\n\r\n", 1)[0], answer[:200]
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "malformed_request") and "malformed" in error["message"], error
    answer = await raw(hostile_gw, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n" + framings[0] + b"\r\n{}")
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    await still_serving(hostile_gw, customer_key["key"])


async def test_refusals_before_the_app_speak_anthropics_shape_on_its_routes(hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    """431 and 408 are written by the connection, before any route: on /v1/messages they are
    Anthropic's `{"type": "error", "error": {"type", "message"}}` (its SDKs read `error.type`), as
    every other refusal there is; elsewhere OpenAI's."""
    def anthropic_error(answer: bytes, status: bytes) -> dict[str, Any]:
        assert answer.startswith(b"HTTP/1.1 " + status + b" "), answer[:100]
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body  # type: ignore[no-any-return]

    big = b"X-Big: " + b"a" * (MAX_HEADER_BYTES + 10) + b"\r\n"
    anthropic_error(await raw(hostile_gw, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n"), b"431")
    many = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 100) for i in range(300))
    anthropic_error(await raw(hostile_gw, b"POST /v1/messages/count_tokens HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"), b"431")
    head = (f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {customer_key['key']}\r\n"
            "Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n{").encode()
    assert "not received" in anthropic_error(await raw(hostile_gw, head), b"408")["error"]["message"]
    openai = await raw(hostile_gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
    assert json.loads(openai.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"
    await still_serving(hostile_gw, customer_key["key"])


async def test_slowloris_gets_408_and_does_not_starve_others(hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    host, port = hostile_gw.base_url.removeprefix("http://").split(":")

    async def drip_headers() -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        answer = asyncio.create_task(read_all(reader))
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            for i in range(40):  # a header line every 0.2 s: it would never finish on its own
                if answer.done():
                    break
                writer.write(b"X-Slow-%d: a\r\n" % i)
                await writer.drain()
                await asyncio.sleep(0.2)
        except (ConnectionError, OSError):
            pass  # the server closed it under us
        try:
            return await asyncio.wait_for(answer, 10)
        finally:
            writer.close()

    async def slow_body() -> bytes:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {customer_key['key']}\r\n"
                "Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n{").encode()
        return await raw(hostile_gw, head)

    async def idle() -> bytes:
        return await raw(hostile_gw, b"")

    started = time.monotonic()
    attackers = [asyncio.create_task(f()) for f in (drip_headers, slow_body, idle) for _ in range(10)]
    await asyncio.sleep(0.3)
    await still_serving(hostile_gw, customer_key["key"])  # served while 30 slow sockets are open
    answers = await asyncio.gather(*attackers)
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:120]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < READ_TIMEOUT + 5  # each closed at the deadline, not left open
    await still_serving(hostile_gw, customer_key["key"])


async def test_invalid_utf8_and_deep_nesting_are_400(client: httpx.AsyncClient, hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    headers = {"content-type": "application/json"}
    for body in (
        b'\xff\xfe{"model": 1}',
        b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "caf\xe9 \xc3"}]}',
        b'{"model": "x", "messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate escape
        b"[" * 5000 + b"]" * 5000,
        b'{"a":' * 3000 + b"1" + b"}" * 3000,
    ):
        clear_error(await client.post("/v1/chat/completions", content=body, headers=headers), 400)
    nested: Any = "deep"
    for _ in range(900):  # inside orjson's depth limit: pydantic refuses the shape instead
        nested = [nested]
    clear_error(await client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": nested}]}), 400)
    clear_error(await client.post("/v1/chat/completions", json={**CHAT, "stop": nested}), 400)
    clear_error(await client.post("/v1/chat/completions", content=b"", headers=headers), 400)
    clear_error(await client.post("/v1/chat/completions", content=b"null", headers=headers), 400)
    await still_serving(hostile_gw, customer_key["key"])


async def test_json_nested_past_what_the_gateway_writes_again_is_a_400_everywhere(
        client: httpx.AsyncClient, hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    """orjson reads 1,024 levels; what the gateway writes again does not: orjson.dumps stops at 255
    (a batch's lines, the response cache's key) and the json module near 1,000 (an Anthropic
    tool_use's input). Each of these was a 500 (and a dropped keep-alive connection); a body nested
    past MAX_JSON_DEPTH is a 400 before any route looks at it, in the API's own shape."""
    from gateway.http.requests import MAX_JSON_DEPTH

    def nested(levels: int) -> str:  # a placeholder replaced with raw JSON text: no encoder here nests that deep
        return f"@nested{levels}@"

    def raw(body: dict[str, Any]) -> bytes:
        text = json.dumps(body)
        for levels in (300, 990, MAX_JSON_DEPTH - 5):
            text = text.replace(f'"@nested{levels}@"', '{"x":' * levels + '"deep"' + "}" * levels)
        return text.encode()

    deep = nested(300)
    cases = [
        ("/v1/chat/completions", {**CHAT, "extra_field": deep}, {"X-Tollgate-Cache": "on"}),
        ("/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": nested(990)}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}]}, {}),
        ("/v1/messages/batches", {"requests": [{"custom_id": "a", "params": {
            "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}], "x": deep}}]}, {}),
    ]
    for path, body, headers in cases:
        r = await client.post(path, content=raw(body), headers={"content-type": "application/json", **headers})
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        message = r.json()["error"]["message"]
        assert f"more than {MAX_JSON_DEPTH} levels" in message, (path, message)
    ok = await client.post("/v1/chat/completions", content=raw({**CHAT, "extra_field": nested(MAX_JSON_DEPTH - 5)}),
                           headers={"content-type": "application/json", "X-Tollgate-Cache": "on"})
    assert ok.status_code == 200, ok.text
    await still_serving(hostile_gw, customer_key["key"])


async def test_a_repeated_query_parameter_is_400_naming_it(client: httpx.AsyncClient, hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    # Parameter pollution: with `account_id` twice a handler would read whichever copy it reads; the
    # request is refused before any handler sees it. One copy, or none, is served as before.
    own = customer_key["account_id"]
    for query in (f"account_id={own}&account_id={own + 1}", f"account_id={own}&group_by=model&account_id={own}"):
        err = clear_error(await client.get(f"/v1/usage?{query}"), 400)
        assert err["param"] == "account_id" and "more than once" in err["message"], err
    assert (await client.get(f"/v1/usage?account_id={own}&group_by=model")).status_code == 200
    assert (await client.get("/v1/usage")).status_code == 200
    await still_serving(hostile_gw, customer_key["key"])


async def test_huge_and_bad_max_tokens(client: httpx.AsyncClient, hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    for bad in (10**30, -1, 0, "100", 1.5, True, [5], {"n": 1}):
        clear_error(await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": bad}), 400, "invalid_value")
    too_big = b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "max_tokens": 18446744073709551617}'  # over 64 bits
    clear_error(await client.post("/v1/completions", content=too_big, headers={"content-type": "application/json"}), 400)
    # A huge but valid max_tokens is past the context: refused, as OpenAI and vLLM refuse it.
    clear_error(await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2**62}), 400, "context_length_exceeded")
    # Without one the bound is the rest of the context; a small budget refuses that worst case.
    unbounded = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    small = await hostile_gw.new_key()
    async with hostile_gw.admin_client() as a:
        r = await a.patch(f"/admin/keys/{small['id']}", json={"limits": {"monthly_tokens": 100}})
        assert r.status_code == 200
    async with httpx.AsyncClient(base_url=hostile_gw.base_url, headers={"Authorization": f"Bearer {small['key']}"}, timeout=30) as c:
        clear_error(await c.post("/v1/chat/completions", json=unbounded), 429, "monthly_tokens")
    body = {**unbounded, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                break  # leave after the first chunk: the request is cancelled, not run to the context's end
    row = await hostile_gw.ledger_row(rid)
    assert row["status"] in ("cancelled", "completed") and row["completion_tokens"] < 2048
    await still_serving(hostile_gw, customer_key["key"])


async def test_bad_admin_limits_and_ids(hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    kid = customer_key["id"]
    async with hostile_gw.admin_client() as a:
        for limits in (
            {"rpm": -1}, {"tpm": "abc"}, {"max_concurrent": 1.5}, {"monthly_tokens": 2**80}, {"monthly_tokens": True},
            {"monthly_spend": 12.5}, {"monthly_spend": "-3"}, {"monthly_spend": "abc"}, {"monthly_spend": "NaN"},
            {"monthly_spend": "Infinity"}, {"monthly_spend": "1e400"}, {"monthly_spend": "0.0000000001"}, {"bogus": 1},
        ):
            clear_error(await a.patch(f"/admin/keys/{kid}", json={"limits": limits}), 400)
        for body in ({"limits": [1, 2]}, {"limits": "rpm=5"}, {}, [1]):
            clear_error(await a.patch(f"/admin/keys/{kid}", json=body), 400)
        for query in ("account_id=-1", "account_id=abc", "account_id=1e3", "account_id=99999999999999999999999"):
            clear_error(await a.get(f"/admin/keys?{query}"), 400)
        for query in ("limit=-5", "limit=abc", "start=yesterday", "end=-1", "start=99999999999999999999"):
            clear_error(await a.get(f"/admin/usage?{query}"), 400)
        for path in ("/admin/keys/abc", "/admin/keys/-1", "/admin/keys/0", "/admin/keys/99999999999999999999",
                     "/admin/keys/2147483648", "/admin/accounts/1e9", "/admin/accounts/99999999999999999999/prices",
                     "/admin/invoices/99999999999999999999"):
            clear_error(await a.get(path), 404)
        clear_error(await a.post("/admin/keys", json={"account_id": 2**40}), 400)
        clear_error(await a.post("/admin/keys", json={"account_id": "1"}), 400)
        clear_error(await a.post("/admin/prices", json={"model": MODEL, "input_per_million": "-1", "output_per_million": "1"}), 400)
        clear_error(await a.post("/admin/prices", json={"model": MODEL, "input_per_million": 0.1, "output_per_million": "1"}), 400)
    await still_serving(hostile_gw, customer_key["key"])


async def test_admin_values_no_column_or_parser_takes_are_400s_naming_them(hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    """What the fuzz audit found as 500s or taken: instants that leave datetime's range in UTC, a
    tax_id_type that is no string, Decimal-only spellings of an amount ("1_000", " 1 ", "1e3"), lax
    booleans, alert URLs nothing can be posted to. Each a 400 naming its field."""
    account = customer_key["account_id"]
    edges = ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00")
    async with hostile_gw.admin_client() as a:
        for when in edges:
            for path, body, field in (
                ("/admin/keys", {"account_id": account, "expires_at": when}, "expires_at"),
                (f"/admin/accounts/{account}/prices", {"model": MODEL, "multiplier": "2", "effective_from": when}, "effective_from"),
                (f"/admin/accounts/{account}/credits", {"kind": "grant", "amount": "1", "expires_at": when}, "expires_at"),
                ("/admin/prices", {"model": MODEL, "input_per_million": "1", "output_per_million": "1", "effective_from": when}, "effective_from"),
            ):
                assert clear_error(await a.post(path, json=body), 400)["param"] == field, (path, when)
        past = {"model": MODEL, "input_per_million": "1", "output_per_million": "1", "effective_from": "2001-01-01T00:00:00Z"}
        assert clear_error(await a.post("/admin/prices", json=past), 400)["param"] == "effective_from"
        details = {"legal_name": "Acme", "country": "DE", "tax_id": "DE123456789"}
        for bad in ([], {}, ["eu_vat"], 7):
            r = await a.put(f"/admin/accounts/{account}/billing_details", json={**details, "tax_id_type": bad})
            assert clear_error(r, 400)["param"] == "tax_id_type", bad
        for amount in ("1_000", " 1 ", "1e3", "0x10", "1,5"):
            assert clear_error(await a.post(f"/admin/accounts/{account}/credits", json={"kind": "grant", "amount": amount}), 400)["param"] == "amount"
            clear_error(await a.patch(f"/admin/keys/{customer_key['id']}", json={"limits": {"monthly_spend": amount}}), 400)
            price = {"model": MODEL, "input_per_million": amount, "output_per_million": "1"}
            assert clear_error(await a.post("/admin/prices", json=price), 400)["param"] == "input_per_million"
            r = await a.post(f"/admin/accounts/{account}/alerts", json={"metric": "monthly_spend", "threshold": amount, "url": "https://example.com/h"})
            assert clear_error(r, 400)["param"] == "threshold", amount
        # a limit Decimal would print in exponent form ("1E-7", "0E-9") is stored and read back plainly,
        # and the key still authenticates (a stored "1E-7" used to lock the account's keys out)
        for spend in ("0.0000001", "0.000000000"):
            r = await a.patch(f"/admin/keys/{customer_key['id']}", json={"limits": {"monthly_spend": spend}})
            assert r.status_code == 200 and r.json()["limits"]["monthly_spend"] == spend, r.text
            async with httpx.AsyncClient(base_url=hostile_gw.v1, headers={"Authorization": f"Bearer {customer_key['key']}"}) as c:
                assert (await c.get("/models")).status_code == 200
        assert (await a.patch(f"/admin/keys/{customer_key['id']}", json={"limits": {"monthly_spend": None}})).status_code == 200
        r = await a.put("/admin/tax_rates/DE", json={"rate": "-0"})
        assert r.status_code == 200 and r.json()["rate"] == "0.000", r.text
        assert (await a.delete("/admin/tax_rates/DE")).status_code in (200, 204)
        clear_error(await a.post("/admin/invoices/close", json={"period": "2026-01", "wait": 0}), 400)
        clear_error(await a.post(f"/admin/accounts/{account}/prices", json={"model": MODEL, "clear": 1}), 400)
        for url in ("https://", "http://a b", "https://x\ny", "ftp://example.com/h", "https://example.com:99999/h"):
            r = await a.post(f"/admin/accounts/{account}/alerts", json={"metric": "monthly_spend", "threshold": "1.00", "url": url})
            assert clear_error(r, 400)["param"] == "url", url
    await still_serving(hostile_gw, customer_key["key"])


async def test_path_traversal_in_invoice_downloads(hostile_gw: Gateway, customer_key: dict[str, Any]) -> None:
    paths = [
        "/v1/invoices/..%2F..%2F..%2Fetc%2Fpasswd", "/v1/invoices/1/..%2F..%2Fetc%2Fpasswd", "/v1/invoices/%2e%2e/pdf",
        "/v1/invoices/1/pdf%00.html", "/v1/invoices/1/..", "/v1/invoices/1/.%2e/.%2e/secret",
        "/admin/invoices/..%2f1/pdf", "/admin/invoices/1/..%2F..%2F..%2Fetc%2Fpasswd", "/admin/invoices/1/%2e%2e%2fpdf",
        "/static/vendor/..%2F..%2F..%2Fetc%2Fpasswd", "/static/vendor/%2e%2e/%2e%2e/pyproject.toml",
    ]
    for key in (customer_key["key"], hostile_gw.admin_key):
        for path in paths:  # raw bytes on the wire: an HTTP client would normalise the dots away
            answer = await raw(hostile_gw, f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n".encode())
            assert answer.startswith(b"HTTP/1.1 404 "), (path, answer[:200])
            body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["message"] and b"root:" not in answer and b"[project]" not in answer
    await still_serving(hostile_gw, customer_key["key"])
