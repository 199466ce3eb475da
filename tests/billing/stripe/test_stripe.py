"""Stripe through the official SDK against FakeStripe: pushing invoices (retries, crashes at every
step, totals compared), webhooks (signatures, replays, out-of-order events) driving the billing
state, and the 403 for suspended accounts. An optional live test runs against Stripe test mode."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from stripe import APIConnectionError, APIError, AuthenticationError, IdempotencyError, InvalidRequestError, StripeClient

from billing import migrate
from billing.config import BillingConfig
from billing.db import create_engine
from billing.invoices.views import get_invoice, list_invoices
from billing.invoices.close import close_period
from billing.keys.store import KeyStore
from billing.prices.book import PriceBook
from billing.invoices.scheduler import MonthlyClose
from billing.stripe.sync import StripeSync, StripeTotalMismatch, stripe_client
from billing.stripe.webhooks import WebhookHandler, WebhookRejected
from gateway.app import create_app
from gateway.config import Settings
from tests.billing.invoice_helpers import App, at, new_account, new_key, price_history, serve, usage
from tests.billing.invoices.test_invoices import AFTER_OCT, SEPT, september
from tests.conftest import SECRET, ServerThread, bootstrap, flush_ledger, stop_server
from tests.fakes.engine import FakeEngine
from tests.fakes.stripe_server import FakeStripe


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    server = FakeStripe().start()
    yield server
    server.stop()


def config_for(fake: FakeStripe, **overrides: Any) -> BillingConfig:
    return BillingConfig(stripe_api_key=fake.api_key, stripe_api_base=fake.url, stripe_webhook_secret=fake.webhook_secret, **overrides)


async def closed_september(db: Any) -> tuple[dict[str, int], dict[int, dict[str, Any]]]:
    ids = await september(db)
    await close_period(db, PriceBook(db), SEPT, now=AFTER_OCT)
    return ids, {i["account_id"]: i for i in await list_invoices(db, period="2026-09")}


async def test_push_creates_customer_draft_items_finalizes_and_sends(db: Any, fake: FakeStripe) -> None:
    ids, invoices = await closed_september(db)
    sync = StripeSync(db, stripe_client(config_for(fake)), config_for(fake))
    fake.fail("POST", r"/v1/invoiceitems", 500)  # the SDK retries these with the same idempotency key
    fake.fail("POST", r"/v1/invoices/[^/]+/finalize", 429)
    result = await sync.push(invoices[ids["a"]]["id"])
    assert result["result"] == "synced" and result["stripe_status"] == "open" and result["stripe_total_cents"] == 89

    ours = await get_invoice(db, invoices[ids["a"]]["id"])
    assert ours is not None
    remote = fake.invoices[ours["stripe"]["invoice_id"]]
    assert remote["status"] == "open" and remote["total"] == 89 and remote["collection_method"] == "send_invoice"
    assert remote["metadata"] == {"tollgate_invoice": ours["number"], "tollgate_period": "2026-09"}
    assert fake.sent == {remote["id"]: 1}
    items = sorted(fake.items_of(remote["id"]), key=lambda i: int(i["metadata"]["tollgate_line"].split("/")[1]))
    assert [i["amount"] for i in items] == [line["amount_cents"] for line in ours["lines"]] == [15, 15, 51, 6, 1, 1]
    assert items[2]["description"] == ours["lines"][2]["description"] and "2,525,000" in items[2]["description"]
    assert "$0.200 per 1M tokens" in items[2]["description"] and items[2]["currency"] == "usd"
    customer = fake.customers[remote["customer"]]
    assert customer["name"] == "a-corp" and customer["metadata"]["tollgate_account_id"] == str(ids["a"])

    # the retried requests reused one idempotency key each
    posts = [r for r in fake.requests if r[0] == "POST" and r[1] == "/v1/invoiceitems"]
    assert len(posts) == 7 and posts[0][2] == posts[1][2] and [r[3] for r in posts[:2]] == [500, 200]
    assert fake.count("POST", r"/v1/invoices/[^/]+/finalize") == 2

    # pushing again changes nothing on either side: reads only
    posts, items_before = fake.count("POST", r".*"), dict(fake.items)
    again = await sync.push(invoices[ids["a"]]["id"])
    assert again["stripe_invoice_id"] == remote["id"] and again["stripe_total_cents"] == 89
    assert fake.count("POST", r".*") == posts and fake.items == items_before and fake.sent == {remote["id"]: 1}


async def test_crash_at_every_step_recovers_without_duplicates(db: Any, fake: FakeStripe) -> None:
    """Each step's response is lost after Stripe did the work (and the SDK's retries too), then a day
    passes (idempotency keys expire) before the re-run: stored ids and metadata lookups keep it single."""
    ids, invoices = await closed_september(db)
    config = config_for(fake, stripe_max_retries=1)
    sync = StripeSync(db, stripe_client(config), config)
    invoice_id = invoices[ids["a"]]["id"]
    steps = [("POST", r"/v1/customers", 0), ("POST", r"/v1/invoices", 0), ("POST", r"/v1/invoiceitems", 0),
             ("POST", r"/v1/invoices/[^/]+/finalize", 500)]
    for method, path, status in steps:
        fake.fail(method, path, status, times=2)  # the call and its one retry
        with pytest.raises((APIConnectionError, APIError)):
            await sync.push(invoice_id)
        stored = await get_invoice(db, invoice_id)
        assert stored is not None and stored["stripe"]["error"]
        fake.forget_idempotency_keys()
    result = await sync.push(invoice_id)
    assert result["result"] == "synced"

    assert len(fake.customers) == 1
    assert len(fake.invoices) == 1
    (remote,) = fake.invoices.values()
    stored = await get_invoice(db, invoice_id)
    assert stored is not None and stored["stripe"]["invoice_id"] == remote["id"] and stored["stripe"]["error"] is None
    assert len(fake.items_of(remote["id"])) == 6 and remote["total"] == 89 and remote["status"] == "open"
    assert fake.sent == {remote["id"]: 1}
    async with db.connect() as conn:
        item_ids = (await conn.execute(sa.text("SELECT stripe_item_id FROM invoice_lines WHERE invoice_id = :i"), {"i": invoice_id})).scalars().all()
    assert sorted(item_ids) == sorted(i["id"] for i in fake.items_of(remote["id"]))


async def test_total_mismatch_is_an_error_not_finalized(db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    ids, invoices = await closed_september(db)
    config = config_for(fake, stripe_max_retries=0)
    sync = StripeSync(db, stripe_client(config), config)
    invoice_id = invoices[ids["a"]]["id"]
    fake.fail("POST", r"/v1/invoices/[^/]+/finalize", 500)
    with pytest.raises(APIError):
        await sync.push(invoice_id)
    (remote,) = fake.invoices.values()
    # someone adds an item to the draft in Stripe's dashboard
    outside = StripeClient(fake.api_key, base_addresses={"api": fake.url})
    await outside.v1.invoice_items.create_async({"customer": remote["customer"], "invoice": remote["id"], "amount": 500, "currency": "usd"})
    with pytest.raises(StripeTotalMismatch, match=r"Stripe 5\.89, Tollgate 0\.89"):
        await sync.push(invoice_id)
    assert remote["status"] == "draft"
    assert invoice_id not in [r["id"] for r in await sync.push_pending()]  # a mismatch waits for a person
    with serve(db_url, tmp_path, **env_for(fake)) as app:
        async with app.admin() as admin:
            r = await admin.post(f"/admin/invoices/{invoice_id}/sync")
            assert r.status_code == 502 and r.json()["error"]["code"] == "stripe_total_mismatch"
            assert "total mismatch" in (await admin.get(f"/admin/invoices/{invoice_id}")).json()["stripe"]["error"]


async def test_scheduler_closes_and_pushes(db: Any, fake: FakeStripe) -> None:
    ids = await september(db)
    config = config_for(fake, close_delay_seconds=3600)
    job = MonthlyClose(db, PriceBook(db), config, stripe=StripeSync(db, stripe_client(config), config), clock=lambda: at(10, 1, 2))
    result = await job.tick()
    assert result is not None and len(result.created) == 2
    totals = sorted(i["total"] for i in fake.invoices.values())
    assert totals == [51, 89] and all(i["status"] == "open" for i in fake.invoices.values())
    assert {i["stripe"]["status"] for i in await list_invoices(db, period="2026-09")} == {"open"}
    assert ids


def env_for(fake: FakeStripe, **extra: str) -> dict[str, str]:
    return {"TOLLGATE_STRIPE_API_KEY": fake.api_key, "TOLLGATE_STRIPE_API_BASE": fake.url,
            "TOLLGATE_STRIPE_WEBHOOK_SECRET": fake.webhook_secret, **extra}


async def wait_for(predicate: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


async def test_webhooks_drive_billing_state(db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    ids, invoices = await closed_september(db)
    key = await new_key(db, ids["a"])
    principal = await KeyStore(db, SECRET.encode()).authenticate(key)
    assert principal is not None
    invoice_id = invoices[ids["a"]]["id"]
    # Stripe charges the invoice (its failed payment is what counts: a sent invoice's due date,
    # a month after these tests' past dates, would count too: tests/billing/stripe/test_overdue.py)
    env = env_for(fake, TOLLGATE_BILLING_GRACE_SECONDS="3", TOLLGATE_STRIPE_COLLECTION_METHOD="charge_automatically")
    with serve(db_url, tmp_path, **env) as app:
        hook = app.base_url + "/webhooks/stripe"
        async with app.admin() as admin:
            assert (await admin.post(f"/admin/invoices/{invoice_id}/sync")).json()["stripe_status"] == "open"
            remote_id = (await admin.get(f"/admin/invoices/{invoice_id}")).json()["stripe"]["invoice_id"]

            async def state() -> str:
                return str((await admin.get(f"/admin/accounts/{ids['a']}/billing")).json()["state"])

            async def events() -> int:
                async with db.connect() as conn:
                    return int((await conn.execute(sa.text("SELECT count(*) FROM stripe_events"))).scalar_one())

            failed = fake.fail_payment(remote_id)
            # forged or broken deliveries: 400, nothing recorded, nothing changed
            for kwargs in ({"secret": "whsec_wrong"}, {"signature": ""}, {"signature": "t=abc,v1=00"},
                           {"signature": fake.sign(b"{}")}, {"signature": "garbage"}):
                r = await fake.deliver(failed, hook, **kwargs)
                assert r.status_code == 400, (kwargs, r.text)
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            stale = fake.sign(b"x", timestamp=int(time.time()) - 3600)
            assert (await fake.deliver(failed, hook, signature=stale)).status_code == 400
            async with app.as_key(key) as raw:
                body = b"\xff\xfe not json"
                r = await raw.post("/webhooks/stripe", content=body, headers={"Stripe-Signature": fake.sign(body)})
                assert r.status_code == 400
                r = await raw.post("/webhooks/stripe", content=b" " * ((1 << 20) + 1), headers={"Stripe-Signature": "t=1,v1=00"})
                assert r.status_code == 413
            assert await events() == 0 and await state() == "active"

            # payment failed: past_due during the grace period (from the event's `created`: a fresh one, so
            # the forged deliveries above do not eat the 3 s on a loaded machine), then suspended
            failed = fake.fail_payment(remote_id)
            r = await fake.deliver(failed, hook)
            assert r.status_code == 200 and r.json()["state"] == "past_due", r.text
            assert app.billing.states.suspension(principal) is None  # still served within the grace period
            await wait_for(lambda: _is(state, "suspended"))
            await wait_for(lambda: _suspended(app, principal))
            reason = app.billing.states.suspension(principal)  # its 403 over HTTP: test_suspended_key_gets_403_on_every_paid_endpoint
            assert reason is not None and invoices[ids["a"]]["number"] in reason and "0.89 USD" in reason
            async with app.as_key(key) as customer:  # a suspended customer can still read what is owed
                assert (await customer.get("/v1/invoices")).status_code == 200

            # a replay has no second effect
            r = await fake.deliver(failed, hook)
            assert r.status_code == 200 and r.json()["duplicate"] is True
            assert await events() == 1

            # an older failure delivered after the payment does not undo it (the object is re-read)
            late_failure = fake.fail_payment(remote_id)
            paid = fake.pay(remote_id)
            assert (await fake.deliver(paid, hook)).json()["state"] == "active"
            assert (await fake.deliver(late_failure, hook)).json()["state"] == "active"
            await wait_for(lambda: _not_suspended(app, principal))
            assert app.billing.states.suspension(principal) is None
            ours = (await admin.get(f"/admin/invoices/{invoice_id}")).json()
            assert ours["status"] == "paid" and ours["paid_at"] is not None and ours["stripe"]["status"] == "paid"
            assert await events() == 3

            # subscriptions: past_due marks the account, active clears it, deletion clears it too
            customer = fake.invoices[remote_id]["customer"]
            r = await fake.deliver(fake.set_subscription(customer, "past_due"), hook)
            assert r.json()["state"] == "past_due"
            sub_id = next(iter(fake.subscriptions))
            assert (await fake.deliver(fake.set_subscription(customer, "active", sub_id), hook)).json()["state"] == "active"
            unpaid = fake.set_subscription(customer, "unpaid", sub_id)
            canceled = fake.set_subscription(customer, "canceled", sub_id)
            assert (await fake.deliver(canceled, hook)).json()["state"] == "active"
            assert (await fake.deliver(unpaid, hook)).json()["state"] == "active"  # out of order: Stripe says canceled

            # events about objects that are not ours are acknowledged and change nothing
            stranger = await StripeClient(fake.api_key, base_addresses={"api": fake.url}).v1.customers.create_async({"name": "x"})
            other = fake._create_invoice({"customer": stranger.id, "collection_method": "charge_automatically"})
            fake._create_item({"customer": stranger.id, "invoice": other["id"], "amount": "500", "currency": "usd"})  # $5: at least Stripe's minimum charge
            fake._finalize({}, other["id"])
            r = await fake.deliver(fake.fail_payment(other["id"]), hook)
            assert r.status_code == 200 and r.json()["account_id"] is None

            # signed bodies that are JSON but not an event object: a 400, never a 500
            before = await events()
            async with app.as_key(key) as raw:
                # and events whose id or type no Stripe event has (a NUL, a lone surrogate, past the column, not
                # a string), or JSON nested past what the parser takes: a 500 with a traceback before
                odd = [b'"evt_\\u0000"', b'"\\ud800"', b'"evt_' + b"x" * 300 + b'"', b'["evt_1"]', b'{"a": 1}']
                for body in (b"[]", b'["evt_1"]', b"42", b'{"id": "evt_x", "type": "invoice.paid", "data": []}',
                             *(b'{"id": "evt_t", "type": "invoice.paid", "created": %s, "data": {"object": {"id": "in_1"}}}' % t
                               for t in (b'"abc"', b"1e400", b"true", b"99999999999999999999")),
                             *(b'{"id": %s, "type": "invoice.paid", "created": 1, "data": {"object": {"id": "in_1"}}}' % i for i in odd),
                             b'{"id": "evt_y", "type": "invoice.' + b"x" * 200 + b'", "created": 1, "data": {"object": {"id": "in_1"}}}',
                             b'{"id": "evt_z", "type": "invoice.paid\\u0000", "created": 1, "data": {"object": {"id": "in_1"}}}',
                             b"[" * 3000 + b"]" * 3000):
                    r = await raw.post("/webhooks/stripe", content=body, headers={"Stripe-Signature": fake.sign(body)})
                    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, (body[:80], r.text)
                    assert r.json()["error"]["code"] == "invalid_event", r.text  # signed: the body is at fault, not the signature
                body = b'{"id": "evt_s", "type": "invoice.paid", "created": 1, "data": {"object": {"id": "in_1"}}}'
                r = await raw.post("/webhooks/stripe", content=body, headers={"Stripe-Signature": fake.sign(body, secret="whsec_wrong")})
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_signature"
            assert await events() == before


async def _is(state: Any, expected: str) -> bool:
    return bool(await state() == expected)


async def _suspended(app: Any, principal: Any) -> bool:
    return app.billing.states.suspension(principal) is not None  # type: ignore[no-any-return]


async def _not_suspended(app: Any, principal: Any) -> bool:
    return app.billing.states.suspension(principal) is None  # type: ignore[no-any-return]


@contextmanager
def serve_alpha(db_url: str, tmp: Path, **billing: str) -> Iterator[App]:
    """The gateway app of invoice_helpers.serve with a model named `alpha` (a FakeEngine) and the
    default embedding model, so that a request past the guard is really served."""
    admin_key = bootstrap(db_url, SECRET)
    extra = {"TOLLGATE_BILLING_AUTO_CLOSE": "0", "TOLLGATE_BILLING_STATE_REFRESH_SECONDS": "0.1", **billing}
    settings = Settings(database_url=db_url, server_secret=SECRET, data_dir=tmp, extra=extra)
    app = create_app(settings, engines={"alpha": FakeEngine("alpha")})
    server = ServerThread(app).__enter__()
    try:
        yield App(db_url, admin_key, f"http://127.0.0.1:{server.port}", app)
    finally:
        stop_server(server)


def _every_paid_path() -> list[tuple[str, dict[str, Any]]]:
    chat = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    text = {"model": "alpha", "prompt": "hi", "max_tokens": 2}
    return [
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/completions", text),
        ("/v1/completions", {**text, "stream": True}),
        ("/v1/embeddings", {"model": "all-minilm-l6-v2", "input": "hi", "encoding_format": "float"}),
        ("/v1/messages", {"model": "alpha", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),  # Anthropic's API
    ]


async def _rows_of(db: Any, request_ids: list[str]) -> int:
    async with db.connect() as conn:
        q = sa.text("SELECT count(*) FROM ledger_entries WHERE request_id IN :ids").bindparams(sa.bindparam("ids", expanding=True))
        return int((await conn.execute(q, {"ids": request_ids})).scalar_one())


async def test_suspended_key_gets_403_on_every_paid_endpoint(db_url: str, db: Any, fake: FakeStripe, tmp_path: Path) -> None:
    """Through HTTP, always: chat and completions (streamed and not), embeddings and Anthropic's
    messages answer 403
    `account_suspended` naming the unpaid invoice, nothing reaches an engine or the ledger; once the
    invoice is paid the same five requests are served (so the 403 was the suspension's)."""
    ids, invoices = await closed_september(db)
    key = await new_key(db, ids["a"])
    number = invoices[ids["a"]]["number"]
    with serve_alpha(db_url, tmp_path, **env_for(fake, TOLLGATE_BILLING_GRACE_SECONDS="0")) as app:
        hook = app.base_url + "/webhooks/stripe"
        async with app.admin() as admin, app.as_key(key) as client:
            await admin.post(f"/admin/invoices/{invoices[ids['a']]['id']}/sync")
            remote_id = (await admin.get(f"/admin/invoices/{invoices[ids['a']]['id']}")).json()["stripe"]["invoice_id"]
            assert (await fake.deliver(fake.fail_payment(remote_id), hook)).json()["state"] == "suspended"
            refused = []
            for path, body in _every_paid_path():
                r = await client.post(path, json=body)
                assert r.status_code == 403, (path, body, r.status_code, r.text)
                error = r.json()["error"]
                if path == "/v1/messages":  # Anthropic's error shape
                    assert error["type"] == "permission_error" and number in error["message"], r.text
                else:
                    assert error["code"] == "account_suspended" and number in error["message"], (path, r.text)
                refused.append(r.headers["x-request-id"])
            await flush_ledger(app.app)
            assert await _rows_of(db, refused) == 0  # refused before admission: no row, nothing billed

            assert (await fake.deliver(fake.pay(remote_id), hook)).json()["state"] == "active"
            served = []
            for path, body in _every_paid_path():
                r = await client.post(path, json=body)
                assert r.status_code == 200, (path, body, r.status_code, r.text)
                served.append(r.headers["x-request-id"])
            await flush_ledger(app.app)
            assert await _rows_of(db, served) == len(served)  # the same requests, served and metered


async def test_webhooks_off_without_settings(db_url: str, tmp_path: Path) -> None:
    with serve(db_url, tmp_path) as app:
        async with app.admin() as admin:
            r = await admin.post("/webhooks/stripe", content=b"{}", headers={"Stripe-Signature": "t=1,v1=00"})
            assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.optional  # strict mode allows this skip: CI has no Stripe secret
@pytest.mark.skipif(not os.environ.get("TOLLGATE_TEST_STRIPE_KEY", "").startswith("sk_test_"),
                    reason="live Stripe test: set TOLLGATE_TEST_STRIPE_KEY to a test-mode secret key")
async def test_live_stripe_test_mode(db: Any) -> None:
    book = PriceBook(db)
    await price_history(book)
    account = await new_account(db, f"tollgate-live-{int(time.time())}")
    await usage(db, account, "alpha", 1_000_000, 1_000_000, at(9, 5))
    await close_period(db, book, SEPT, now=AFTER_OCT)
    config = BillingConfig(stripe_api_key=os.environ["TOLLGATE_TEST_STRIPE_KEY"], send_invoices=False)
    (invoice,) = await list_invoices(db, period="2026-09")
    result = await StripeSync(db, stripe_client(config), config).push(invoice["id"])
    assert result["stripe_status"] == "open" and result["stripe_total_cents"] == invoice["total_cents"] == 75


async def test_stripe_and_webhooks_on_sqlite(tmp_path: Path, fake: FakeStripe) -> None:
    """The embedded default database takes the same path: sync, a failed payment, a replay, payment."""
    url = f"sqlite:///{tmp_path / 'tollgate.db'}"
    migrate.upgrade(url)
    db = create_engine(url)
    try:
        book = PriceBook(db)
        await price_history(book)
        account = await new_account(db)
        await usage(db, account, "alpha", 4_000_000, 0, at(9, 5))  # $0.60: Stripe charges no less than $0.50
        await close_period(db, book, SEPT, now=AFTER_OCT)
        config = config_for(fake, grace_seconds=0)
        (invoice,) = await list_invoices(db)
        pushed = await StripeSync(db, stripe_client(config), config).push(invoice["id"])
        assert pushed["stripe_total_cents"] == 60
        handler = WebhookHandler(db, stripe_client(config), fake.webhook_secret, grace_seconds=0)
        failed = json.dumps(fake.fail_payment(pushed["stripe_invoice_id"])).encode()
        assert (await handler.handle(failed, fake.sign(failed)))["state"] == "suspended"
        assert (await handler.handle(failed, fake.sign(failed)))["duplicate"] is True
        paid = json.dumps(fake.pay(pushed["stripe_invoice_id"])).encode()
        assert (await handler.handle(paid, fake.sign(paid)))["state"] == "active"
        with pytest.raises(WebhookRejected):
            await handler.handle(paid, fake.sign(paid, secret="whsec_other"))
        assert (await get_invoice(db, invoice["id"]))["status"] == "paid"  # type: ignore[index]
    finally:
        await db.dispose()


async def test_fake_stripe_behaves_like_stripe_for_the_sdk(fake: FakeStripe) -> None:
    """What the sync relies on, seen through the official SDK: replays, key reuse, error shapes."""
    client = StripeClient(fake.api_key, base_addresses={"api": fake.url}, max_network_retries=0)
    params = {"name": "n", "metadata": {"tollgate_account": "1-2"}}
    first = await client.v1.customers.create_async(params, {"idempotency_key": "k-1"})
    replay = await client.v1.customers.create_async(params, {"idempotency_key": "k-1"})
    assert replay.id == first.id and len(fake.customers) == 1
    assert replay.last_response.headers.get("Idempotent-Replayed") == "true"
    with pytest.raises(IdempotencyError, match="same parameters"):
        await client.v1.customers.create_async({"name": "other"}, {"idempotency_key": "k-1"})
    with pytest.raises(InvalidRequestError) as missing:
        await client.v1.invoices.retrieve_async("in_missing")
    assert missing.value.http_status == 404 and missing.value.code == "resource_missing"
    with pytest.raises(InvalidRequestError) as bad:
        await client.v1.invoice_items.create_async({"customer": first.id, "amount": "12.5", "currency": "usd"})
    assert bad.value.http_status == 400 and bad.value.param == "amount"
    with pytest.raises(AuthenticationError):
        await StripeClient("sk_test_wrong", base_addresses={"api": fake.url}).v1.customers.retrieve_async(first.id)
    # no result is stored for a request that failed before running: the retry runs it
    fake.fail("POST", r"/v1/customers", 500)
    with pytest.raises(APIError):
        await client.v1.customers.create_async({"name": "x"}, {"idempotency_key": "k-2"})
    assert (await client.v1.customers.create_async({"name": "x"}, {"idempotency_key": "k-2"})).name == "x"
