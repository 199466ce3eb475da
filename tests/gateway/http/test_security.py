"""Security (issue 8): keys only as keyed hashes at rest and never in logs, metrics or error bodies;
customer keys kept off every admin endpoint and out of other accounts' data (every route that takes
an id); timeouts on every outbound call; CORS off; security headers on pages."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa
from starlette.routing import Route

from billing.db import create_engine
from billing.prices.book import PriceBook
from gateway.http.logs import JsonFormatter
from tests.billing.invoice_helpers import usage
from tests.conftest import MODEL, Gateway, minute_with_room, run_coro, start_gateway
from tests.fakes.engine import FakeEngine
from tests.gateway.dashboard.test_dashboard_security import TOKEN, browser

PAST = "2026-10"
IN_PAST = datetime(2026, 10, 15, 12, tzinfo=timezone.utc)


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] not in ("httpx", "httpcore"):  # the test's own HTTP client, not the server
            self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def secure_gw(fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    server, gw = start_gateway(fresh_pg_database(migrated=True), FakeEngine(MODEL), tmp_path_factory.mktemp("gw-security"))
    try:
        yield gw
    finally:
        server.__exit__()


@pytest.fixture(scope="module")
def two_accounts(secure_gw: Gateway) -> dict[str, Any]:
    """Accounts a and b, a key each, and an invoice each for a closed month."""

    async def setup() -> dict[str, Any]:
        a, b = await secure_gw.new_key(), await secure_gw.new_key()
        db = create_engine(secure_gw.db_url)
        try:
            await PriceBook(db).add(MODEL, "1.000", "2.000", datetime(2026, 9, 1, tzinfo=timezone.utc), backdate=True)
            for key in (a, b):
                await usage(db, key["account_id"], MODEL, 1_000_000, 500_000, IN_PAST)  # $2.00: something to credit
        finally:
            await db.dispose()
        async with secure_gw.admin_client() as admin:
            closed = await admin.post("/admin/invoices/close", json={"period": PAST, "wait": True})
            assert closed.status_code == 200, closed.text
            invoices = (await admin.get(f"/admin/invoices?period={PAST}")).json()["data"]
        by_account = {i["account_id"]: i["id"] for i in invoices}
        return {"a": a, "b": b, "a_invoice": by_account[a["account_id"]], "b_invoice": by_account[b["account_id"]]}

    return run_coro(setup())  # type: ignore[no-any-return]


def as_key(gw: Gateway, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def fill(path: str, ids: dict[str, Any]) -> str:
    return re.sub(r"\{(\w+)(:\w+)?\}", lambda m: str(ids[m.group(1)]), path)


def id_routes(gw: Gateway) -> set[tuple[str, str]]:
    return {(m, r.path) for r in gw.app.routes if isinstance(r, Route) and "{" in r.path for m in (r.methods or ()) if m != "HEAD"}


async def test_customer_keys_never_reach_admin_endpoints(secure_gw: Gateway, two_accounts: dict[str, Any]) -> None:
    b = two_accounts["b"]
    ids = {"account_id": b["account_id"], "key_id": b["id"], "invoice_id": two_accounts["b_invoice"], "fmt": "pdf", "period": PAST, "note_id": 1,
           "country": "DE", "statement_id": 1}
    tried = 0
    async with as_key(secure_gw, two_accounts["a"]["key"]) as c:
        for route in secure_gw.app.routes:
            if not isinstance(route, Route) or not route.path.startswith("/admin"):
                continue
            for method in (route.methods or set()) - {"HEAD"}:
                r = await c.request(method, fill(route.path, ids), json={} if method in ("POST", "PATCH") else None)
                assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required", (method, route.path, r.text)
                tried += 1
    assert tried >= 20
    async with secure_gw.admin_client() as admin:  # and nothing happened to b
        assert (await admin.get(f"/admin/keys/{b['id']}")).json()["revoked_at"] is None


async def test_admin_endpoints_refuse_callers_without_a_valid_key(secure_gw: Gateway, two_accounts: dict[str, Any]) -> None:
    """Every /admin route answers 401 before its handler runs when no key, or no known key, is sent;
    the check comes after routing, so an unknown /admin path is still a 404 and a wrong method a 405."""
    b = two_accounts["b"]
    ids = {"account_id": b["account_id"], "key_id": b["id"], "invoice_id": two_accounts["b_invoice"], "fmt": "pdf", "period": PAST, "note_id": 1,
           "country": "DE", "statement_id": 1}
    callers = {"missing_api_key": {}, "invalid_api_key": {"Authorization": "Bearer sk-" + "0" * 40}}
    tried = 0
    async with httpx.AsyncClient(base_url=secure_gw.base_url, timeout=30) as c:
        for route in secure_gw.app.routes:
            if not isinstance(route, Route) or not route.path.startswith("/admin"):
                continue
            for method in (route.methods or set()) - {"HEAD"}:
                for code, headers in callers.items():
                    r = await c.request(method, fill(route.path, ids), headers=headers, json={} if method in ("POST", "PATCH") else None)
                    assert r.status_code == 401 and r.json()["error"]["code"] == code, (method, route.path, code, r.text)
                tried += 1
        assert (await c.get("/admin/no_such_thing")).status_code == 404
        assert (await c.delete("/admin/accounts")).status_code == 405
    assert tried >= 40


async def test_one_account_never_reads_another(secure_gw: Gateway, two_accounts: dict[str, Any]) -> None:
    a, b = two_accounts["a"], two_accounts["b"]
    checked: set[tuple[str, str]] = set()
    async with as_key(secure_gw, a["key"]) as c:
        for suffix in ("", "/html", "/pdf"):
            own = await c.get(f"/v1/invoices/{two_accounts['a_invoice']}{suffix}")
            assert own.status_code == 200  # the same call works on its own invoice
            assert own.headers["cache-control"] == "no-store"  # an account's own documents: no cache keeps them
            other = await c.get(f"/v1/invoices/{two_accounts['b_invoice']}{suffix}")
            assert other.status_code == 404 and str(b["account_id"]) not in other.text.replace(str(two_accounts["b_invoice"]), "")
            checked.add(("GET", "/v1/invoices/{invoice_id}" + ("/{fmt:str}" if suffix else "")))
        listed = (await c.get("/v1/invoices")).json()["data"]
        assert [i["id"] for i in listed] == [two_accounts["a_invoice"]]
        assert (await c.get(f"/v1/usage?account_id={a['account_id']}")).status_code == 200
        refused = await c.get(f"/v1/usage?account_id={b['account_id']}")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "account_not_allowed"
        usage = await c.get("/v1/usage")
        assert usage.json()["account_id"] == a["account_id"] and usage.headers["cache-control"] == "no-store"
        for path in ("/v1/billing/balance", "/v1/statements", "/v1/billing/alerts"):
            assert (await c.get(path)).headers.get("cache-control") == "no-store", path
    # /v1/models/{id} answers with the caller's account's price: another account's override (a
    # reseller's discount) must never show through it. The model allowlist is per key.
    await models_probe(secure_gw, a)
    checked.add(("GET", "/v1/models/{model_id:path}"))
    checked |= await stored_responses_probe(secure_gw, a, b)
    checked |= await batches_probe(secure_gw, a, b)

    # The dashboards: a customer's session gets no admin page or form, whatever id it names.
    s = browser(secure_gw)
    form = s.get("/dashboard/login")
    assert s.post("/dashboard/login", data={"csrf_token": TOKEN.search(form.text).group(1), "api_key": a["key"]}).status_code == 303
    token = TOKEN.search(s.get("/dashboard/account").text).group(1)
    documents = await documents_probe(secure_gw, s, two_accounts) | await statements_probe(secure_gw, s, two_accounts)
    checked |= documents
    ids = {"account_id": b["account_id"], "key_id": b["id"]}
    for method, path in sorted(id_routes(secure_gw)):
        if not path.startswith("/dashboard") or (method, path) in documents:
            continue
        data = {"csrf_token": token, "name": "x", "models": "m", "rpm": "1"} if method == "POST" else None
        r = s.request(method, fill(path, ids), data=data)
        assert r.status_code == 403, (method, path, r.status_code)
        checked.add((method, path))
    async with secure_gw.admin_client() as admin:
        after = (await admin.get(f"/admin/keys/{b['id']}")).json()
        assert after["revoked_at"] is None and after["limits"] == {} and after["models"] is None
    admin_only = {(m, p) for m, p in id_routes(secure_gw) if p.startswith("/admin")}  # covered by the test above
    assert id_routes(secure_gw) - admin_only <= checked, "a route that takes an id has no cross-account check here"


async def documents_probe(gw: Gateway, session: httpx.Client, accounts: dict[str, Any]) -> set[tuple[str, str]]:
    """A credit note on each account's invoice (issue 22). a's key reads its own note, JSON, HTML and PDF,
    and gets 404s naming nothing of b for b's; a's dashboard session downloads its own invoice and
    note and gets 404 for b's (the session authorises its own account's documents only)."""
    a, b = accounts["a"], accounts["b"]
    notes: dict[str, int] = {}
    async with gw.admin_client() as admin:
        for who in ("a", "b"):
            made = await admin.post(f"/admin/invoices/{accounts[who + '_invoice']}/credit_notes", json={"amount_cents": 1, "memo": "probe"})
            assert made.status_code == 201, made.text
            notes[who] = made.json()["id"]
    async with as_key(gw, a["key"]) as c:
        for suffix in ("", "/html", "/pdf"):
            assert (await c.get(f"/v1/credit_notes/{notes['a']}{suffix}")).status_code == 200
            other = await c.get(f"/v1/credit_notes/{notes['b']}{suffix}")
            assert other.status_code == 404 and str(b["account_id"]) not in other.text.replace(str(notes["b"]), ""), other.text
    for kind, own, theirs in (("invoices", accounts["a_invoice"], accounts["b_invoice"]), ("credit_notes", notes["a"], notes["b"])):
        for fmt in ("html", "pdf"):
            assert session.get(f"/dashboard/{kind}/{own}/{fmt}").status_code == 200
            other = session.get(f"/dashboard/{kind}/{theirs}/{fmt}")
            assert other.status_code == 404, (kind, fmt, other.status_code)
    return {("GET", "/v1/credit_notes/{note_id}"), ("GET", "/v1/credit_notes/{note_id}/{fmt:str}"),
            ("GET", "/dashboard/invoices/{doc_id}/{fmt}"), ("GET", "/dashboard/credit_notes/{doc_id}/{fmt}")}


async def statements_probe(gw: Gateway, session: httpx.Client, accounts: dict[str, Any]) -> set[tuple[str, str]]:
    """A prepaid statement for each account (issue 25). a's key reads its own, JSON, HTML and PDF, and
    lists only its own; b's is a 404 naming nothing of b; a's dashboard session likewise."""
    from billing.invoices.periods import Period
    from billing.invoices.statements import close_statement

    a, b = accounts["a"], accounts["b"]
    db = create_engine(gw.db_url)
    made: dict[str, int] = {}
    try:
        for who in ("a", "b"):
            account = accounts[who]["account_id"]
            # As if prepaid since the month began: the statement is made, then the account is back as it was
            # (its billing mode never changed, so the other tests' requests are unaffected).
            async with db.begin() as conn:
                await conn.execute(sa.text("UPDATE accounts SET prepaid_since = :t WHERE id = :a"), {"t": Period.parse(PAST).start, "a": account})
            statement_id, _ = await close_statement(db, account, Period.parse(PAST), now=datetime.now(timezone.utc))
            async with db.begin() as conn:
                await conn.execute(sa.text("UPDATE accounts SET prepaid_since = NULL WHERE id = :a"), {"a": account})
            assert statement_id is not None
            made[who] = statement_id
    finally:
        await db.dispose()
    async with as_key(gw, a["key"]) as c:
        assert [st["id"] for st in (await c.get("/v1/statements")).json()["data"]] == [made["a"]]
        for suffix in ("", "/html", "/pdf"):
            assert (await c.get(f"/v1/statements/{made['a']}{suffix}")).status_code == 200
            other = await c.get(f"/v1/statements/{made['b']}{suffix}")
            assert other.status_code == 404 and str(b["account_id"]) not in other.text.replace(str(made["b"]), ""), other.text
    for fmt in ("html", "pdf"):
        assert session.get(f"/dashboard/statements/{made['a']}/{fmt}").status_code == 200
        assert session.get(f"/dashboard/statements/{made['b']}/{fmt}").status_code == 404
    return {("GET", "/v1/statements/{statement_id}"), ("GET", "/v1/statements/{statement_id}/{fmt:str}"),
            ("GET", "/dashboard/statements/{doc_id}/{fmt}")}


async def stored_responses_probe(gw: Gateway, a: dict[str, Any], b: dict[str, Any]) -> set[tuple[str, str]]:
    """b stores a response (the Responses API); a cannot read, list the input of, or delete it by
    its id: each is a 404 that says nothing of b. b still reads it afterwards."""
    async with as_key(gw, b["key"]) as c:
        made = await c.post("/v1/responses", json={"model": MODEL, "input": "Say hi.", "max_output_tokens": 16, "temperature": 0})
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
    async with as_key(gw, a["key"]) as c:
        for method, path in (("GET", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}/input_items"), ("DELETE", f"/v1/responses/{rid}")):
            r = await c.request(method, path)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
            assert str(b["account_id"]) not in r.text.replace(rid, "")
    async with as_key(gw, b["key"]) as c:
        assert (await c.get(f"/v1/responses/{rid}")).status_code == 200
    return {("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"), ("GET", "/v1/responses/{response_id}/input_items")}


async def batches_probe(gw: Gateway, a: dict[str, Any], b: dict[str, Any]) -> set[tuple[str, str]]:
    """b uploads a batch file and starts an OpenAI batch and an Anthropic message batch; a cannot read,
    download, delete or cancel any of them by id: each is a 404 that says nothing of b."""
    line = orjson.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}})
    async with as_key(gw, b["key"]) as c:
        uploaded = await c.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", line + b"\n")})
        assert uploaded.status_code == 200, uploaded.text
        fid = uploaded.json()["id"]
        made = await c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        assert made.status_code == 200, made.text
        bid = made.json()["id"]
        message_batch = await c.post("/v1/messages/batches", json={"requests": [{"custom_id": "m1", "params": {
            "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}}]})
        assert message_batch.status_code == 200, message_batch.text
        mid = message_batch.json()["id"]
    probes = [("GET", "/v1/files/{file_id}", fid), ("GET", "/v1/files/{file_id}/content", fid), ("DELETE", "/v1/files/{file_id}", fid),
              ("GET", "/v1/batches/{batch_id}", bid), ("POST", "/v1/batches/{batch_id}/cancel", bid),
              ("GET", "/v1/messages/batches/{batch_id}", mid), ("POST", "/v1/messages/batches/{batch_id}/cancel", mid),
              ("DELETE", "/v1/messages/batches/{batch_id}", mid),
              ("GET", "/v1/messages/batches/{batch_id}/results", mid)]
    async with as_key(gw, a["key"]) as c:
        for method, path, own_id in probes:
            r = await c.request(method, re.sub(r"\{\w+\}", own_id, path))
            assert r.status_code == 404, (method, path, r.status_code, r.text)
            # what the answer names of its own (the batch id asked for, this request's id, which
            # Anthropic's error bodies carry) aside, nothing of b's: its account id appears nowhere
            assert str(b["account_id"]) not in r.text.replace(own_id, "").replace(r.headers["x-request-id"], ""), r.text
    async with as_key(gw, b["key"]) as c:  # nothing of b's was deleted or cancelled
        assert (await c.get(f"/v1/files/{fid}")).status_code == 200
        assert (await c.get(f"/v1/batches/{bid}")).json()["status"] not in ("cancelling", "cancelled")
        assert (await c.get(f"/v1/messages/batches/{mid}")).json().get("cancel_initiated_at") is None  # and still there
    return {(method, path) for method, path, _ in probes}


async def models_probe(gw: Gateway, a: dict[str, Any]) -> None:
    other = await gw.new_key()  # another account, with a 0.25x override of the model's price
    async with gw.admin_client() as admin:
        r = await admin.post(f"/admin/accounts/{other['account_id']}/prices", json={"model": MODEL, "multiplier": "0.25"})
        assert r.status_code == 201, r.text

    def price(card: dict[str, Any]) -> tuple[Decimal, Decimal]:
        return Decimal(card["pricing"]["input_per_million"]), Decimal(card["pricing"]["output_per_million"])

    async with as_key(gw, other["key"]) as c:
        deadline = time.monotonic() + 15  # the serving price book reloads every few seconds
        while price(own := (await c.get(f"/v1/models/{MODEL}")).json()) != (Decimal("0.25"), Decimal("0.5")):
            assert time.monotonic() < deadline, own
            await asyncio.sleep(0.2)
    async with as_key(gw, a["key"]) as c:
        for _ in range(3):  # after the other account's cards were priced: nothing of theirs is reused
            card = await c.get(f"/v1/models/{MODEL}")
            assert card.status_code == 200 and price(card.json()) == (Decimal("1"), Decimal("2")), card.text
            listed = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
            assert price(listed[MODEL]) == (Decimal("1"), Decimal("2"))
            async with as_key(gw, other["key"]) as o:
                assert price((await o.get(f"/v1/models/{MODEL}")).json()) == (Decimal("0.25"), Decimal("0.5"))
    narrow = await gw.new_key(a["account_id"], models=["another-model"])
    async with as_key(gw, narrow["key"]) as c:
        r = await c.get(f"/v1/models/{MODEL}")
        assert r.status_code == 404 and "pricing" not in r.text


async def test_keys_never_leak_into_logs_metrics_errors_or_storage(secure_gw: Gateway, two_accounts: dict[str, Any]) -> None:
    captured = Captured()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(captured)
    root.setLevel(logging.DEBUG)
    exposed: list[str] = []  # every byte a client or scraper saw, except the one answer that hands out a secret
    try:
        a = two_accounts["a"]["key"]
        limited = await secure_gw.new_key()
        revoked = await secure_gw.new_key()
        async with secure_gw.admin_client() as admin:
            await admin.patch(f"/admin/keys/{limited['id']}", json={"limits": {"rpm": 1}})
            await admin.delete(f"/admin/keys/{revoked['id']}")
            created = await admin.post("/admin/keys", json={"account_id": two_accounts["a"]["account_id"]})
            for path in ("/admin/keys", f"/admin/keys/{limited['id']}", "/admin/accounts", "/admin/usage", "/admin/invoices"):
                r = await admin.get(path)
                exposed.append(r.text + str(r.headers))
        secrets = [a, limited["key"], revoked["key"], created.json()["key"], secure_gw.admin_key]
        ghost = "sk-" + uuid.uuid4().hex + uuid.uuid4().hex  # key-shaped, unknown
        secrets.append(ghost)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
        flows: list[tuple[str, str, str, Any, dict[str, str]]] = [
            (a, "POST", "/v1/chat/completions", chat, {}),
            (a, "POST", "/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}, {}),
            (a, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, {}),
            (a, "GET", "/v1/models", None, {}), (a, "GET", "/v1/usage?group_by=model,key", None, {}),
            (a, "GET", "/v1/invoices", None, {}), (a, "GET", f"/v1/invoices/{two_accounts['a_invoice']}/html", None, {}),
            (a, "POST", "/v1/chat/completions", {**chat, "model": a}, {}),  # the key as a model name: 404 echoing it
            (a, "POST", "/v1/chat/completions", {**chat, "user": a, "messages": [{"role": "user", "content": a}]}, {}),
            (a, "POST", "/v1/chat/completions", {**chat, "max_tokens": a}, {}),  # 400 naming the bad value
            (a, "GET", f"/v1/models/{a}", None, {}), (a, "GET", f"/v1/usage?start={a}", None, {}),
            (a, "GET", f"/v1/invoices/{a}/pdf", None, {}), (a, "GET", f"/nowhere/{a}?key={a}", None, {}),
            (a, "POST", "/v1/chat/completions", b"{" + a.encode(), {"content-type": "application/json"}),
            (a, "POST", "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x" * 2_000_000}]}, {}),
            (a, "POST", "/admin/accounts", {"name": a}, {}),
            (ghost, "GET", "/v1/models", None, {}), (revoked["key"], "POST", "/v1/chat/completions", chat, {}),
            (limited["key"], "POST", "/v1/chat/completions", chat, {}), (limited["key"], "POST", "/v1/chat/completions", chat, {}),
            (secure_gw.admin_key, "PATCH", f"/admin/keys/{limited['id']}", {"limits": {"rpm": a}}, {}),
            (secure_gw.admin_key, "GET", f"/admin/keys/{secure_gw.admin_key}", None, {}),
            ("", "GET", "/v1/models", None, {"Authorization": f"Basic {a}"}),
            ("", "GET", "/v1/models", None, {"Authorization": f"Bearer {a} {a}"}),
            # an upload whose file name holds a NUL (no text column can keep it) and whose content a key:
            # a 400 naming the file, not a database error whose text carried the file's bytes into the log
            (a, "POST", "/v1/files", b"--XX\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--XX\r\n"
             b"Content-Disposition: form-data; name=\"file\"; filename=\"a\x00b\"\r\n\r\n{\"note\": \"" + a.encode() + b"\"}\n\r\n--XX--\r\n",
             {"content-type": "multipart/form-data; boundary=XX"}),
        ]
        statuses = set()
        answered: list[str] = []  # the server's request ids: each must have its access line before we look
        await minute_with_room(20)  # the limited key's two requests in one minute's window (the second is a 429)
        async with httpx.AsyncClient(base_url=secure_gw.base_url, timeout=30) as c:
            for key, method, path, body, headers in flows:
                hdrs = {"Authorization": f"Bearer {key}"} if key else {}
                hdrs.update(headers)
                kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = await c.request(method, path, headers=hdrs, **kwargs)
                statuses.add(r.status_code)
                if path == "/v1/files":
                    assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
                exposed.append(r.text + str(r.headers))
                answered.append(r.headers["x-request-id"])
            exposed.append((await c.get("/metrics")).text)
        assert {200, 400, 401, 403, 404, 413, 429} <= statuses  # successes, errors and quota rejections all ran
        s = browser(secure_gw)  # dashboard logins, right and wrong
        for key in (a, ghost, secure_gw.admin_key):
            form = s.get("/dashboard/login")
            r = s.post("/dashboard/login", data={"csrf_token": TOKEN.search(form.text).group(1), "api_key": key})
            exposed.append(r.text + str(r.headers) + s.get("/dashboard").text)
        # Barriers instead of a pause: every row recorded is in the database, and every request
        # above has its access line in the captured log.
        await secure_gw.flush_ledger()
        deadline = time.monotonic() + 30
        while missing_lines := [rid for rid in answered if not any(f'"request_id": "{rid}"' in l or f'"request_id":"{rid}"' in l
                                                                  for l in captured.lines if '"tollgate.access"' in l)]:
            assert time.monotonic() < deadline, f"no access line for {len(missing_lines)} requests, e.g. {missing_lines[0]}"
            await asyncio.sleep(0.02)
    finally:
        root.removeHandler(captured)
        root.setLevel(old_level)

    at_rest = [p.read_bytes().decode("latin-1") for p in Path(secure_gw.settings.data_dir).rglob("*") if p.is_file()]
    db = create_engine(secure_gw.db_url)
    try:
        async with db.connect() as conn:
            tables = (await conn.execute(sa.text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'"))).scalars().all()
            for table in tables:
                rows = (await conn.execute(sa.text(f'SELECT * FROM "{table}"'))).all()
                at_rest.append(repr(rows))
    finally:
        await db.dispose()
    haystacks = {"logs": "\n".join(captured.lines), "responses and metrics": "\n".join(exposed), "storage": "\n".join(at_rest)}
    assert len(captured.lines) > 20 and len(tables) >= 5
    for where, text in haystacks.items():
        for secret in secrets:
            assert secret not in text, f"a raw key appears in {where}"
            assert secret[3:] not in text, f"a raw key's secret part appears in {where}"


async def test_error_logs_carry_no_statement_parameters_and_no_key(fresh_pg_database: Any) -> None:
    """What reaches an error log from a failed statement: its SQL, never its parameters (a customer's
    text, a file's bytes: `hide_parameters`), and anything shaped like a key in a message or an
    exception's text is masked (JsonFormatter). Before, an upload that failed in the database logged
    the file's first bytes, a key in them included."""
    from sqlalchemy.exc import DBAPIError

    key = "sk-" + uuid.uuid4().hex + uuid.uuid4().hex
    db = create_engine(fresh_pg_database(migrated=True))
    try:
        async with db.connect() as conn:
            with pytest.raises(DBAPIError) as failed:
                await conn.execute(sa.text("SELECT CAST(:v AS text)"), {"v": key + "\x00"})
    finally:
        await db.dispose()
    assert key not in str(failed.value) and "hidden due to hide_parameters" in str(failed.value)
    record = logging.LogRecord("tollgate", logging.ERROR, __file__, 1, "unhandled on %s", (f"/v1/files?k={key}",), None)
    try:
        raise RuntimeError(f"a library's text with {key}")
    except RuntimeError:
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert key not in line and key[3:] not in line and line.count("sk-***") == 2, line


async def test_a_client_leaving_mid_upload_is_no_server_error(secure_gw: Gateway, two_accounts: dict[str, Any]) -> None:
    """An upload whose client closes the connection before its body has arrived is answered 499 in
    the access log and logs no error (the form's ClientDisconnect is the client's doing). Before, it
    was an `unhandled ClientDisconnect` error with a traceback."""
    captured = Captured()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(captured)
    root.setLevel(logging.INFO)  # the access lines
    mark = "cut-upload-" + uuid.uuid4().hex[:8]
    try:
        host, port = secure_gw.base_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        part = b'--XX\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n{"a": 1'
        writer.write(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + two_accounts["a"]["key"].encode() +
                     b"\r\nx-client-request-id: " + mark.encode() + b"\r\nContent-Type: multipart/form-data; boundary=XX\r\n"
                     b"Content-Length: 100000\r\n\r\n" + part)
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        deadline = time.monotonic() + 30
        while not (lines := [line for line in captured.lines if mark in line and '"tollgate.access"' in line]):
            assert time.monotonic() < deadline, "no access line for the cut upload"
            await asyncio.sleep(0.02)
    finally:
        root.removeHandler(captured)
        root.setLevel(old_level)
    assert '"status":499' in lines[0].replace(" ", ""), lines
    errors = [line for line in captured.lines if '"level":"error"' in line.replace(" ", "")]
    assert not errors, errors


def blackhole() -> tuple[socket.socket, int]:
    """A listener that accepts connections and never says a word."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return srv, srv.getsockname()[1]


async def test_every_outbound_call_has_a_deadline() -> None:
    from billing.quota import LedgerTotals, QuotaUnavailable, RedisLimiter, Scope
    from billing.quota.limits import Limits
    from billing.config import BillingConfig
    from billing.stripe.sync import stripe_client

    srv, port = blackhole()
    try:
        db = create_engine(f"postgresql://postgres@127.0.0.1:{port}/x")  # Postgres that never answers
        started = time.monotonic()
        with pytest.raises(TimeoutError):  # the connect timeout fired (not a refusal, not another error)
            async with db.connect() as conn:
                await conn.execute(sa.text("SELECT 1"))
        waited = time.monotonic() - started
        assert 4.5 <= waited < 8, waited  # the 5 s connect timeout (billing/db.py), not forever and not at once
        await db.dispose()

        lim = RedisLimiter(f"redis://127.0.0.1:{port}/0", LedgerTotals(create_engine("sqlite:///:memory:")), timeout=0.05)
        started = time.monotonic()
        with pytest.raises(QuotaUnavailable, match="TimeoutError"):  # the Redis timeout, as fail-closed
            await lim.reserve("r", [Scope("key", 1, Limits(rpm=5))], 1, 0)
        waited = time.monotonic() - started
        assert 0.045 <= waited < 1, waited  # the 50 ms timeout ran out, not forever
        await lim.close()
    finally:
        srv.close()
    # Stripe: the SDK's HTTP client has a finite timeout; the engines' pools set theirs (tests/engines).
    client = stripe_client(BillingConfig.from_mapping({"TOLLGATE_STRIPE_API_KEY": "sk_test_x"}))
    assert 0 < client._requestor._client._timeout <= 80  # type: ignore[attr-defined]


async def test_cors_is_off_and_pages_carry_security_headers(secure_gw: Gateway, two_accounts: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=secure_gw.base_url, timeout=30) as c:
        pre = await c.options("/v1/chat/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization",
        })
        assert pre.status_code in (404, 405) and not any(h.startswith("access-control-") for h in pre.headers)
        r = await c.get("/v1/models", headers={"Origin": "https://evil.example", "Authorization": f"Bearer {two_accounts['a']['key']}"})
        assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
        assert r.headers["x-content-type-options"] == "nosniff"
        login = await c.get("/dashboard/login")
        page = await c.get(f"/v1/invoices/{two_accounts['a_invoice']}/html", headers={"Authorization": f"Bearer {two_accounts['a']['key']}"})
        for response in (login, page):
            assert response.headers["content-type"].startswith("text/html")
            assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
            assert response.headers["x-frame-options"] == "DENY" and response.headers["x-content-type-options"] == "nosniff"
            assert "referrer-policy" in response.headers
