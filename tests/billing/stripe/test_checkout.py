"""Stripe top-ups of prepaid credit (issue 25), with the official SDK against the FAKE Stripe server
(tests/fakes/stripe_checkout.py: Checkout Sessions, PaymentIntents, Refunds and their signed
events): POST /v1/billing/checkout makes a session; `checkout.session.completed` delivered three
times (and the same session in a second event) credits once; a refund debits; auto-recharge
charges the saved card off-session once while one charge is pending, and a declined card leaves a
clear failed state until it is reset."""

from __future__ import annotations

import asyncio
import random
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing import migrate
from billing.db import create_engine
from billing.keys.store import KeyStore
from tests.billing.invoice_helpers import serve
from tests.conftest import SECRET, run_coro
from tests.fakes.stripe_checkout import FakeStripePayments

CENT = 10_000_000


@pytest.fixture
def fake() -> Iterator[FakeStripePayments]:
    server = FakeStripePayments().start()
    try:
        yield server  # type: ignore[misc]
    finally:
        server.stop()


def stripe_env(fake: FakeStripePayments) -> dict[str, str]:
    return {"TOLLGATE_STRIPE_API_KEY": fake.api_key, "TOLLGATE_STRIPE_API_BASE": fake.url,
            "TOLLGATE_STRIPE_WEBHOOK_SECRET": fake.webhook_secret, "TOLLGATE_STRIPE_SYNC_AFTER_CLOSE": "0",
            "TOLLGATE_CREDITS_CHECK_SECONDS": "0"}


def account_with_key(url: str, prefix: str) -> tuple[int, str]:
    """A new account of the migrated database at `url` and a key of it."""
    migrate.upgrade(url)

    async def make() -> tuple[int, str]:
        db = create_engine(url)
        try:
            keys = KeyStore(db, SECRET.encode())
            account = (await keys.create_account(f"{prefix}-" + uuid.uuid4().hex[:6]))["id"]
            return account, (await keys.create_key(account))["key"]
        finally:
            await db.dispose()

    return run_coro(make())  # type: ignore[no-any-return]


def test_checkout_top_up_credits_once_refund_debits_and_auto_recharge(fake: FakeStripePayments, fresh_pg_database: Any,
                                                                       tmp_path: Path) -> None:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)

    async def make() -> tuple[int, str, str]:
        db = create_engine(url)
        try:
            keys = KeyStore(db, SECRET.encode())
            prepaid = (await keys.create_account("pre-" + uuid.uuid4().hex[:6]))["id"]
            postpaid = (await keys.create_account("post-" + uuid.uuid4().hex[:6]))["id"]
            return prepaid, (await keys.create_key(prepaid))["key"], (await keys.create_key(postpaid))["key"]
        finally:
            await db.dispose()

    account, key, postpaid_key = run_coro(make())
    public = "https://pay.example.com"  # TOLLGATE_PUBLIC_URL: a TLS proxy in front
    with serve(url, tmp_path, public_url=public, **stripe_env(fake)) as app:
        hook = app.base_url + "/webhooks/stripe"
        returns = (f"{public}/dashboard/account?checkout=done", f"{public}/dashboard/account?checkout=cancelled")

        async def scenario() -> None:
            async with app.admin() as admin, app.as_key(key) as customer, app.as_key(postpaid_key) as other:
                assert (await admin.put(f"/admin/accounts/{account}/billing_mode", json={"billing_mode": "prepaid"})).status_code == 200
                r = await other.post("/v1/billing/checkout", json={"amount": "10.00"})
                assert r.status_code == 400 and r.json()["error"]["code"] == "not_prepaid"
                for bad in ("0.10", "10.001", 10.5):
                    r = await customer.post("/v1/billing/checkout", json={"amount": bad})
                    assert r.status_code == 400 and r.json()["error"]["param"] == "amount", r.text
                r = await customer.post("/v1/billing/checkout", json={"amount": "12.34"}, headers={"host": "evil.example"})
                assert r.status_code == 200, r.text
                session = r.json()
                assert session["url"].startswith("https://checkout.stripe.com/") and session["amount_cents"] == 1234
                stored = fake.sessions[session["id"]]
                assert stored["metadata"] == {"tollgate_account": str(account)} and stored["amount_total"] == 1234
                # Stripe sends the payer back to the public URL, never to a Host the proxy passed on
                assert (stored["success_url"], stored["cancel_url"]) == returns

                fake.complete_session(session["id"])
                completed = fake.event_of("checkout.session.completed", session["id"])
                answers = await asyncio.gather(*(fake.deliver(completed, hook) for _ in range(3)))  # delivered three times
                assert [a.status_code for a in answers] == [200, 200, 200]
                assert sum(1 for a in answers if a.json().get("duplicate")) == 2
                again = fake._event("checkout.session.completed", fake._public(stored))  # another event, same session
                assert (await fake.deliver(again, hook)).status_code == 200
                credits = (await admin.get(f"/admin/accounts/{account}/credits")).json()
                assert credits["balance_nanos"] == 1234 * CENT  # $12.34, credited once
                assert [(e["kind"], e["external_id"]) for e in credits["entries"]] == [("topup", session["id"])]
                assert credits["recharge"]["payment_method_id"] is not None  # the card was saved for off-session use
                forged = await fake.deliver(completed, hook, secret="whsec_wrong")
                assert forged.status_code == 400

                refund = fake._create_refund({"payment_intent": stored["payment_intent"], "amount": "234"})
                event = fake.event_of("refund.created", refund["id"])
                for _ in range(2):
                    assert (await fake.deliver(event, hook)).status_code == 200
                assert (await customer.get("/v1/billing/balance")).json()["balance_nanos"] == 1000 * CENT

                # auto-recharge: below $20 -> charge $5 once
                r = await admin.put(f"/admin/accounts/{account}/recharge", json={"recharge_below": "20.00", "recharge_amount": "5.00"})
                assert r.status_code == 200 and r.json()["recharge_state"] == "idle", r.text
                async def run() -> list[int]:  # the periodic work, now (two at once: two instances' timers)
                    r = await admin.post("/admin/credits/housekeeping")
                    assert r.status_code == 200, r.text
                    return list(r.json()["recharged"])

                # Two instances' timers at once: while the first one's charge is in flight at Stripe, the
                # second finds the account's charge pending and charges nothing.
                arrived, release = fake.hold_charges()
                first = asyncio.create_task(run())
                try:
                    assert await asyncio.to_thread(arrived.wait, 30)  # the first run's charge reached Stripe
                    assert await run() == []  # one charge in flight at a time
                finally:
                    fake.release_charges()
                assert len(await first) == 1
                intents = [pi for pi in fake.payment_intents.values() if pi["metadata"].get("tollgate_recharge")]
                assert len(intents) == 1 and intents[0]["amount"] == 500
                succeeded = fake.event_of("payment_intent.succeeded", intents[0]["id"])
                assert (await fake.deliver(succeeded, hook)).status_code == 200  # the webhook after the answer: no second credit
                assert (await customer.get("/v1/billing/balance")).json()["balance_nanos"] == 1500 * CENT

                fake.decline_next()
                assert await run() == []
                state = (await admin.get(f"/admin/accounts/{account}/credits")).json()["recharge"]
                assert state["recharge_state"] == "failed" and "insufficient funds" in state["recharge_error"]
                assert await run() == []  # failed: no new charge until reset
                mine = (await customer.get("/v1/billing/balance")).json()["recharge"]
                assert mine["recharge_state"] == "failed" and "declined" in mine["recharge_error"]
                assert len([pi for pi in fake.payment_intents.values() if pi["metadata"].get("tollgate_recharge")]) == 2
                r = await admin.put(f"/admin/accounts/{account}/recharge", json={"recharge_below": "20.00", "recharge_amount": "5.00"})
                assert r.json()["recharge_state"] == "idle" and r.json()["recharge_error"] is None
                assert len(await run()) == 1
                assert (await customer.get("/v1/billing/balance")).json()["balance_nanos"] == 2000 * CENT
                entries = (await admin.get(f"/admin/accounts/{account}/credits")).json()["entries"]
                assert [e["kind"] for e in entries] == ["topup", "topup", "refund", "topup"]
                assert sum(e["amount_nanos"] for e in entries) == 2000 * CENT

            # the customer dashboard's "Add credit" form: a Checkout Session, then Stripe's page
            async with httpx.AsyncClient(base_url=app.base_url, timeout=30, headers={"origin": app.base_url}) as browser:
                def as_the_proxy_forwards(response: httpx.Response) -> httpx.Response:
                    """The Secure cookies a browser sends the TLS proxy, which forwards them; httpx, on plain
                    http here, would keep them to itself: carried by hand."""
                    for name, value in response.cookies.items():
                        browser.cookies.set(name, value)
                    return response

                form = as_the_proxy_forwards(await browser.get("/dashboard/login")).text
                csrf = re.search(r'name="csrf_token" value="([^"]+)"', form).group(1)  # type: ignore[union-attr]
                login = as_the_proxy_forwards(await browser.post("/dashboard/login", data={"csrf_token": csrf, "api_key": key}))
                assert login.status_code == 303
                page = (await browser.get("/dashboard/account")).text
                assert 'id="checkout-form"' in page and "$20.000000000" in page
                token = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
                before = len(fake.sessions)
                r = await browser.post("/dashboard/checkout", data={"csrf_token": token, "amount": "25.00"})
                assert r.status_code == 303 and r.headers["location"].startswith("https://checkout.stripe.com/c/pay/cs_test_")
                assert len(fake.sessions) == before + 1
                made = list(fake.sessions.values())[-1]
                assert made["amount_total"] == 2500 and (made["success_url"], made["cancel_url"]) == returns
                forged = await browser.post("/dashboard/checkout", data={"csrf_token": "nope", "amount": "25.00"})
                assert forged.status_code in (400, 403) and len(fake.sessions) == before + 1

        run_coro(scenario())


def test_stripe_event_sequences_credit_what_stripe_collected_once(fake: FakeStripePayments, fresh_pg_database: Any,
                                                                  tmp_path: Path) -> None:
    """Each flow sends every event Stripe sends for it (tests/fakes/stripe_checkout.py), in several
    orders and each delivered twice (at least once, in any order, is all Stripe promises), and the
    credit ledger ends at exactly what Stripe collected, net of what it refunded: a card Checkout
    (its `payment_intent.succeeded` and `charge.succeeded` too), a bank-debit Checkout that
    completes unpaid and then succeeds or fails, a refund that later fails, an off-session
    recharge declined for authentication, and one whose answer from Stripe was lost."""
    url = fresh_pg_database(migrated=True)
    account, key = account_with_key(url, "seq")
    rng = random.Random(34)
    with serve(url, tmp_path, **stripe_env(fake)) as app:
        hook = app.base_url + "/webhooks/stripe"

        async def deliver(events: list[dict[str, Any]], order: str = "shuffled") -> None:
            """Each event twice: in the order given, reversed or shuffled, the repeats at the end or at once."""
            sequence = list(events) if order == "as sent" else list(reversed(events)) if order == "reversed" else rng.sample(events, len(events))
            for event in sequence:
                assert (await fake.deliver(event, hook)).status_code == 200, event["type"]
            answers = await asyncio.gather(*(fake.deliver(e, hook) for e in rng.sample(events, len(events))))
            assert all(a.status_code == 200 and a.json().get("duplicate") for a in answers)

        def collected() -> int:
            """What Stripe holds of the account's money, in cents: captured charges less refunds not failed."""
            mine = [c for c in fake.charges.values() if c["metadata"].get("tollgate_account") == str(account)]
            return sum(c["amount_captured"] - c["amount_refunded"] for c in mine)

        async def scenario() -> None:
            async with app.admin() as admin, app.as_key(key) as customer:
                assert (await admin.put(f"/admin/accounts/{account}/billing_mode", json={"billing_mode": "prepaid"})).status_code == 200

                async def balance() -> int:
                    return int((await customer.get("/v1/billing/balance")).json()["balance_nanos"])

                async def session(cents: int) -> str:
                    r = await customer.post("/v1/billing/checkout", json={"amount": f"{cents // 100}.{cents % 100:02d}"})
                    assert r.status_code == 200, r.text
                    return str(r.json()["id"])

                # card Checkouts: four events each, in three orders
                for cents, order in ((1234, "as sent"), (2000, "reversed"), (777, "shuffled")):
                    await deliver(fake.complete_session(await session(cents)), order)
                assert await balance() == collected() * CENT == (1234 + 2000 + 777) * CENT
                assert [e["kind"] for e in (await admin.get(f"/admin/accounts/{account}/credits")).json()["entries"]] == ["topup"] * 3

                # a bank debit: completed unpaid (nothing yet), then it settles; or it fails (nothing ever)
                paid_later, never = await session(5000), await session(900)
                await deliver(fake.complete_session(paid_later, delayed=True) + fake.complete_session(never, delayed=True))
                assert await balance() == collected() * CENT == 4011 * CENT
                await deliver(fake.settle_session(never, succeeded=False) + fake.events_about(never))
                settled = fake.settle_session(paid_later, succeeded=True)
                await deliver(settled + [fake.event_of("checkout.session.completed", paid_later)], "reversed")
                assert await balance() == collected() * CENT == 9011 * CENT

                # a refund that fails later (the card was closed), its events before or after the refund's own
                intent = fake.sessions[paid_later]["payment_intent"]
                kept = fake.refund(intent, 1500)
                await deliver(kept)
                assert await balance() == collected() * CENT == 7511 * CENT
                await deliver(fake.fail_refund(kept[0]["data"]["object"]["id"]))
                assert await balance() == collected() * CENT == 9011 * CENT
                fake.pend_refunds()
                late = fake.refund(intent, 1000)
                fake.pend_refunds(False)
                failed = fake.fail_refund(late[0]["data"]["object"]["id"], "lost_or_stolen_card")
                await deliver(failed + late, "as sent")  # the failure arrives first
                assert await balance() == collected() * CENT == 9011 * CENT
                refunds = [e for e in (await admin.get(f"/admin/accounts/{account}/credits")).json()["entries"] if e["kind"] == "refund"]
                assert sorted(e["amount_nanos"] for e in refunds) == sorted([-1500 * CENT, 1500 * CENT, -1000 * CENT, 1000 * CENT])

                # auto-recharge: the bank wants the customer to authenticate, which cannot happen off-session
                r = await admin.put(f"/admin/accounts/{account}/recharge", json={"recharge_below": "100.00", "recharge_amount": "5.00"})
                assert r.status_code == 200, r.text

                async def run() -> list[int]:
                    r = await admin.post("/admin/credits/housekeeping")
                    assert r.status_code == 200, r.text
                    return list(r.json()["recharged"])

                async def recharge() -> dict[str, Any]:
                    return dict((await admin.get(f"/admin/accounts/{account}/credits")).json()["recharge"])

                fake.require_authentication_next()
                assert await run() == []
                state = await recharge()
                assert state["recharge_state"] == "failed" and "requires authentication" in state["recharge_error"], state
                declined = fake.payment_intents[state["recharge_payment_intent"]]
                assert declined["status"] == "requires_payment_method"
                await deliver(fake.events_about(declined["id"], declined["latest_charge"]))
                assert await balance() == collected() * CENT == 9011 * CENT and (await recharge())["recharge_state"] == "failed"
                r = await admin.put(f"/admin/accounts/{account}/recharge", json={"recharge_below": "100.00", "recharge_amount": "5.00"})
                assert r.json()["recharge_state"] == "idle"
                for event in fake.events_about(declined["id"]):  # redelivered after the reset: the new setting stands
                    assert (await fake.deliver(fake._event(event["type"], event["data"]["object"]), hook)).status_code == 200
                assert (await recharge())["recharge_state"] == "idle"

                # the charge succeeds at Stripe but its answer is lost (the call and the SDK's two retries):
                # pending until its events arrive, which credit it once and free the next charge
                fake.fail("POST", r"/v1/payment_intents", status=0, times=3)
                assert await run() == []
                assert (await recharge())["recharge_state"] == "pending" and await balance() == 9011 * CENT
                lost = next(pi for pi in reversed(fake.payment_intents.values()) if pi["status"] == "succeeded")
                await deliver(fake.events_about(lost["id"], lost["latest_charge"]))
                assert await balance() == collected() * CENT == 9511 * CENT
                state = await recharge()
                assert state["recharge_state"] == "idle" and state["recharge_payment_intent"] == lost["id"], state
                assert len(await run()) == 1  # the next charge is not blocked
                assert await balance() == collected() * CENT == 10011 * CENT
                entries = (await admin.get(f"/admin/accounts/{account}/credits")).json()["entries"]
                assert sum(e["amount_nanos"] for e in entries) == collected() * CENT

        run_coro(scenario())


def test_a_checkout_stripe_cannot_make_is_a_502_and_the_dashboard_says_so(fake: FakeStripePayments, fresh_pg_database: Any,
                                                                          tmp_path: Path) -> None:
    """Stripe down (connection refused) when a customer buys credit: the API answers 502 stripe_error
    with Retry-After, the dashboard goes back to the account page saying it failed (both were a 500),
    nothing is credited, and the server keeps serving."""
    url = fresh_pg_database(migrated=True)
    account, key = account_with_key(url, "pre")
    env = {**stripe_env(fake), "TOLLGATE_STRIPE_MAX_RETRIES": "0"}
    fake.stop()  # nothing answers at its address now
    with serve(url, tmp_path, **env) as app:

        async def scenario() -> None:
            async with app.admin() as admin, app.as_key(key) as customer:
                assert (await admin.put(f"/admin/accounts/{account}/billing_mode", json={"billing_mode": "prepaid"})).status_code == 200
                r = await customer.post("/v1/billing/checkout", json={"amount": "10.00"})
                assert r.status_code == 502 and r.json()["error"]["code"] == "stripe_error" and r.headers["retry-after"], r.text
                assert (await customer.get("/v1/billing/balance")).json()["balance"] == "0.000000000"
            async with httpx.AsyncClient(base_url=app.base_url, timeout=30, headers={"origin": app.base_url}) as browser:
                form = (await browser.get("/dashboard/login")).text
                csrf = re.search(r'name="csrf_token" value="([^"]+)"', form).group(1)  # type: ignore[union-attr]
                assert (await browser.post("/dashboard/login", data={"csrf_token": csrf, "api_key": key})).status_code == 303
                page = (await browser.get("/dashboard/account")).text
                csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
                r = await browser.post("/dashboard/checkout", data={"csrf_token": csrf, "amount": "10.00"})
                assert r.status_code == 303 and r.headers["location"] == "/dashboard/account?checkout=failed", (r.status_code, r.text[:200])
                said = (await browser.get(r.headers["location"])).text
                assert re.search(r'id="checkout-said">Stripe could not start the payment', said), said[-2000:]

        run_coro(scenario())


def test_refunds_and_chargebacks_take_back_the_usd_a_top_up_credited(fake: FakeStripePayments, fresh_pg_database: Any,
                                                                     tmp_path: Path) -> None:
    """The credit is USD; what Stripe says a refund or a dispute took back may not be. With the
    Dashboard's Adaptive Pricing on (`fake.localize`: the customer pays €0.92 per $1.00), a session
    that does not turn it off is paid in EUR, and its refunds and disputes come in EUR cents.
    - Tollgate's sessions turn it off: the top-up is charged in USD, and a full refund takes back
      the whole $10.00. Without it: 920 EUR cents debited as if they were 920 USD cents ($0.80 left).
    - A session paid in EUR (one from before that change): a refund of half and a chargeback of the
      rest each take back $5.00 of its $10.00 (the same share of what its Session credited), not
      460 cents each.
    - A webhook endpoint on an API version before 2024-10-28 gets `charge.refunded` and no
      `refund.created` for a card's refund: it debits too (it was acknowledged and ignored)."""
    url = fresh_pg_database(migrated=True)
    account, key = account_with_key(url, "fx")
    fake.localize("eur", 92)
    with serve(url, tmp_path, **stripe_env(fake)) as app:
        hook = app.base_url + "/webhooks/stripe"

        async def deliver(events: list[dict[str, Any]]) -> None:
            for event in events:
                assert (await fake.deliver(event, hook)).status_code == 200, event["type"]

        async def scenario() -> None:
            async with app.admin() as admin, app.as_key(key) as customer:
                assert (await admin.put(f"/admin/accounts/{account}/billing_mode", json={"billing_mode": "prepaid"})).status_code == 200

                async def balance() -> int:
                    return int((await customer.get("/v1/billing/balance")).json()["balance_nanos"])

                r = await customer.post("/v1/billing/checkout", json={"amount": "10.00"})
                assert r.status_code == 200, r.text
                await deliver(fake.complete_session(r.json()["id"]))
                intent = fake.payment_intents[fake.sessions[r.json()["id"]]["payment_intent"]]
                assert await balance() == 1000 * CENT
                await deliver(fake.refund(intent["id"]))
                assert await balance() == 0
                assert (intent["currency"], intent["amount"]) == ("usd", 1000)
                assert fake.sessions[r.json()["id"]]["adaptive_pricing"] == {"enabled": False}

                made_before = fake._create_session({  # as Tollgate made them before it turned Adaptive Pricing off
                    "mode": "payment", "success_url": "https://x.example/ok", "metadata": {"tollgate_account": str(account)},
                    "line_items": [{"quantity": "1", "price_data": {"currency": "usd", "unit_amount": "1000",
                                                                    "product_data": {"name": "Tollgate prepaid credit"}}}],
                    "payment_intent_data": {"metadata": {"tollgate_account": str(account)}}})
                await deliver(fake.complete_session(made_before["id"]))
                intent = fake.payment_intents[fake.sessions[made_before["id"]]["payment_intent"]]
                assert (intent["currency"], intent["amount"]) == ("eur", 920)
                assert await balance() == 1000 * CENT
                await deliver(fake.refund(intent["id"], 460))
                assert await balance() == 500 * CENT
                await deliver(fake.dispute(intent["id"]))  # the other 460 EUR cents
                assert await balance() == 0

                r = await customer.post("/v1/billing/checkout", json={"amount": "7.00"})
                await deliver(fake.complete_session(r.json()["id"]))
                intent_id = fake.sessions[r.json()["id"]]["payment_intent"]
                old_endpoint = [e for e in fake.refund(intent_id, 300) if e["type"] == "charge.refunded"]
                assert len(old_endpoint) == 1
                await deliver(old_endpoint)
                assert await balance() == 400 * CENT
                entries = (await admin.get(f"/admin/accounts/{account}/credits")).json()["entries"]
                assert sorted(e["amount_nanos"] // CENT for e in entries if e["kind"] == "refund") == [-1000, -500, -500, -300]

        run_coro(scenario())
