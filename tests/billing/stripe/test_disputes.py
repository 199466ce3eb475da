"""Disputes (chargebacks) on the charges that paid prepaid credit (billing/stripe/checkout.py), through
the real webhook endpoint: the official SDK against the FAKE Stripe (tests/fakes/stripe_checkout.py),
signed deliveries, each event repeated and in several orders, also as a second event about the same
dispute. A chargeback takes its amount back once (a `refund` row keyed by the dispute id), whatever
event about it comes first; an inquiry takes nothing until it escalates; a won dispute gives it back
(net zero, also when `won` is the first state seen); a lost one stays debited; a dispute on a charge
that is not Tollgate's changes nothing. The debit reaches admission at once: an account the dispute
left below zero is refused its next paid request, and the disputed card is not charged off-session again."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from billing.db import create_engine
from billing.keys.store import KeyStore
from billing.prices.book import PriceBook
from tests.billing.invoice_helpers import App, serve
from tests.billing.stripe.test_checkout import fake, stripe_env  # noqa: F401  (the fixture)
from tests.conftest import SECRET, flush_ledger, run_coro
from tests.fakes.engine import FakeEngine
from tests.fakes.stripe_checkout import FakeStripePayments

CENT = 10_000_000


@contextmanager
def gateway(fake: FakeStripePayments, fresh_pg_database: Any, tmp_path: Path, **engines: Any) -> Iterator[tuple[App, int, str]]:
    """The gateway on a fresh database with the fake Stripe; a prepaid-to-be account and its key;
    the model `alpha` priced $1/$2 per 1M tokens."""
    url = fresh_pg_database(migrated=True)

    async def make() -> tuple[int, str]:
        db = create_engine(url)
        try:
            keys = KeyStore(db, SECRET.encode())
            account = (await keys.create_account("dispute-" + uuid.uuid4().hex[:6]))["id"]
            await PriceBook(db).add("alpha", "1.000", "2.000")
            return int(account), str((await keys.create_key(account))["key"])
        finally:
            await db.dispose()

    account, key = run_coro(make())
    with serve(url, tmp_path, engines=engines, **stripe_env(fake)) as app:
        yield app, account, key


class Prepaid:
    """One prepaid account's view of the gateway, and Stripe's deliveries to it."""

    def __init__(self, app: App, fake: FakeStripePayments, account: int, admin: httpx.AsyncClient, customer: httpx.AsyncClient,
                 seed: int) -> None:
        self.app, self.fake, self.account, self.admin, self.customer = app, fake, account, admin, customer
        self.hook = app.base_url + "/webhooks/stripe"
        self.rng = random.Random(seed)

    async def start(self) -> None:
        r = await self.admin.put(f"/admin/accounts/{self.account}/billing_mode", json={"billing_mode": "prepaid"})
        assert r.status_code == 200, r.text

    async def pay(self, cents: int) -> tuple[list[dict[str, Any]], str]:
        """A Checkout paid by card (the card saved) on Stripe, its events not delivered yet: the events
        and the PaymentIntent's id."""
        r = await self.customer.post("/v1/billing/checkout", json={"amount": f"{cents // 100}.{cents % 100:02d}"})
        assert r.status_code == 200, r.text
        return self.fake.complete_session(r.json()["id"]), str(self.fake.sessions[r.json()["id"]]["payment_intent"])

    async def top_up(self, cents: int) -> str:
        """A Checkout paid by card (the card saved), its events delivered; the PaymentIntent's id."""
        events, intent = await self.pay(cents)
        await self.deliver(events)
        return intent

    async def deliver(self, events: list[dict[str, Any]], order: str = "as sent") -> list[dict[str, Any]]:
        """Each event in the order given (or reversed, or shuffled), then all again at once (all duplicates),
        then each once more as a new event about the same object (what another event type would carry)."""
        sequence = list(events) if order == "as sent" else list(reversed(events)) if order == "reversed" else self.rng.sample(events, len(events))
        answers = []
        for event in sequence:
            r = await self.fake.deliver(event, self.hook)
            assert r.status_code == 200, (event["type"], r.text)
            answers.append(r.json())
        again = await asyncio.gather(*(self.fake.deliver(e, self.hook) for e in self.rng.sample(events, len(events))))
        assert all(a.status_code == 200 and a.json().get("duplicate") for a in again)
        for event in self.rng.sample(events, len(events)):
            r = await self.fake.deliver(self.fake._event(event["type"], event["data"]["object"]), self.hook)
            assert r.status_code == 200 and not r.json().get("duplicate"), r.text
        return answers

    async def balance(self) -> int:
        return int((await self.customer.get("/v1/billing/balance")).json()["balance_nanos"])

    async def entries(self) -> list[dict[str, Any]]:
        return list((await self.admin.get(f"/admin/accounts/{self.account}/credits")).json()["entries"])

    async def dispute_rows(self, dispute_id: str) -> list[tuple[str, int, str]]:
        return sorted((e["external_id"], e["amount_nanos"], e["kind"]) for e in await self.entries()
                      if (e["external_id"] or "").startswith(dispute_id))


def scenario(fake: FakeStripePayments, fresh_pg_database: Any, tmp_path: Path, body: Any, seed: int = 7, **engines: Any) -> None:
    with gateway(fake, fresh_pg_database, tmp_path, **engines) as (app, account, key):
        async def run() -> None:
            async with app.admin() as admin, app.as_key(key) as customer:
                prepaid = Prepaid(app, fake, account, admin, customer, seed)
                await prepaid.start()
                await body(prepaid)

        run_coro(run())


def test_a_chargeback_debits_its_amount_once_whatever_its_events_order(fake: FakeStripePayments, fresh_pg_database: Any,
                                                                        tmp_path: Path) -> None:
    """created, funds_withdrawn and updated (evidence submitted), each twice, shuffled, reversed, and again as
    new events: one `refund` row of the disputed amount keyed by the dispute id, its reason the dispute's."""
    async def body(p: Prepaid) -> None:
        first, second = await p.top_up(2000), await p.top_up(1500)
        assert await p.balance() == 3500 * CENT
        opened = fake.dispute(first)  # created, funds_withdrawn
        dispute = opened[0]["data"]["object"]["id"]
        answers = await p.deliver(opened, "reversed")  # funds_withdrawn first
        assert [a["account_id"] for a in answers] == [p.account, p.account]
        assert await p.balance() == 1500 * CENT
        await p.deliver(fake.review_dispute(dispute) + opened, "shuffled")
        assert await p.balance() == 1500 * CENT
        assert await p.dispute_rows(dispute) == [(dispute, -2000 * CENT, "refund")]
        row = next(e for e in await p.entries() if e["external_id"] == dispute)
        assert row["reason"] == "Stripe dispute (fraudulent)"
        # a partial dispute of the other top-up: its own amount, its own row
        other = fake.dispute(second, 600, "product_not_received")
        await p.deliver(other, "shuffled")
        assert await p.balance() == 900 * CENT
        assert [e["reason"] for e in await p.entries() if e["external_id"] == other[0]["data"]["object"]["id"]] == [
            "Stripe dispute (product_not_received)"]

    scenario(fake, fresh_pg_database, tmp_path, body)


def test_an_inquiry_takes_nothing_until_it_escalates(fake: FakeStripePayments, fresh_pg_database: Any, tmp_path: Path) -> None:
    """warning_needs_response / warning_under_review / warning_closed: Stripe withdraws nothing, nor does the
    ledger; an inquiry that becomes a chargeback (the same dispute, needs_response) is debited then, once."""
    async def body(p: Prepaid) -> None:
        closed, escalated = await p.top_up(1000), await p.top_up(800)
        asked = fake.dispute(closed, inquiry=True)
        inquiry = asked[0]["data"]["object"]["id"]
        answers = await p.deliver(asked + fake.review_dispute(inquiry) + fake.close_dispute(inquiry, won=True), "shuffled")
        assert all(a["account_id"] is None for a in answers)  # nothing of the account's changed
        assert await p.balance() == 1800 * CENT and await p.dispute_rows(inquiry) == []

        asked = fake.dispute(escalated, reason="unrecognized", inquiry=True)
        inquiry = asked[0]["data"]["object"]["id"]
        await p.deliver(asked)
        assert await p.balance() == 1800 * CENT
        await p.deliver(fake.escalate_dispute(inquiry) + asked, "shuffled")
        assert await p.balance() == 1000 * CENT
        assert await p.dispute_rows(inquiry) == [(inquiry, -800 * CENT, "refund")]

    scenario(fake, fresh_pg_database, tmp_path, body)


def test_a_won_dispute_gives_the_amount_back_also_when_won_is_seen_first(fake: FakeStripePayments, fresh_pg_database: Any,
                                                                         tmp_path: Path) -> None:
    """Won after the debit: a second row (`<dispute id>:won`) gives it back. Won before any other event of
    it arrived (closed and funds_reinstated first): both rows at once, net zero, and the late
    created/funds_withdrawn add nothing."""
    async def body(p: Prepaid) -> None:
        later, early = await p.top_up(1200), await p.top_up(900)
        opened = fake.dispute(later)
        dispute = opened[0]["data"]["object"]["id"]
        await p.deliver(opened)
        assert await p.balance() == 900 * CENT
        await p.deliver(fake.review_dispute(dispute) + fake.close_dispute(dispute, won=True), "shuffled")
        assert await p.balance() == 2100 * CENT
        assert await p.dispute_rows(dispute) == [(dispute, -1200 * CENT, "refund"), (f"{dispute}:won", 1200 * CENT, "refund")]

        opened = fake.dispute(early, 400)
        dispute = opened[0]["data"]["object"]["id"]
        won = fake.close_dispute(dispute, won=True)
        await p.deliver(won, "reversed")  # funds_reinstated, then closed: the first the gateway hears of it
        assert await p.dispute_rows(dispute) == [(dispute, -400 * CENT, "refund"), (f"{dispute}:won", 400 * CENT, "refund")]
        await p.deliver(opened + won, "shuffled")
        assert await p.balance() == 2100 * CENT
        assert len(await p.dispute_rows(dispute)) == 2

    scenario(fake, fresh_pg_database, tmp_path, body)


def test_a_lost_dispute_stays_debited_also_on_an_auto_recharge(fake: FakeStripePayments, fresh_pg_database: Any,
                                                               tmp_path: Path) -> None:
    """A chargeback on an off-session auto-recharge (its PaymentIntent names the account too), lost: the
    debit stays, and the closing events, before or after the others, add nothing back."""
    async def body(p: Prepaid) -> None:
        await p.top_up(1000)
        r = await p.admin.put(f"/admin/accounts/{p.account}/recharge", json={"recharge_below": "20.00", "recharge_amount": "7.00"})
        assert r.status_code == 200, r.text
        r = await p.admin.post("/admin/credits/housekeeping")
        assert r.status_code == 200 and r.json()["recharged"] == [p.account], r.text
        recharge = next(pi for pi in fake.payment_intents.values() if pi["metadata"].get("tollgate_recharge"))
        assert await p.balance() == 1700 * CENT
        opened = fake.dispute(recharge["id"], reason="duplicate")
        dispute = opened[0]["data"]["object"]["id"]
        lost = fake.review_dispute(dispute) + fake.close_dispute(dispute, won=False)
        await p.deliver(lost + opened, "as sent")  # closed (lost) first
        assert await p.balance() == 1000 * CENT
        await p.deliver(opened + lost, "shuffled")
        assert await p.balance() == 1000 * CENT
        assert await p.dispute_rows(dispute) == [(dispute, -700 * CENT, "refund")]

    scenario(fake, fresh_pg_database, tmp_path, body)


def test_a_dispute_on_a_charge_that_is_not_ours_changes_nothing(fake: FakeStripePayments, fresh_pg_database: Any,
                                                                tmp_path: Path) -> None:
    """A payment made on the same Stripe account without Tollgate (no tollgate_account metadata), disputed and
    lost: every event is answered 200 (Stripe stops retrying) and no account changes."""
    async def body(p: Prepaid) -> None:
        await p.top_up(1000)
        elsewhere = fake.payment(1000)
        opened = fake.dispute(elsewhere["id"])
        dispute = opened[0]["data"]["object"]["id"]
        answers = await p.deliver(opened + fake.close_dispute(dispute, won=False), "shuffled")
        assert all(a["account_id"] is None for a in answers)
        assert await p.balance() == 1000 * CENT
        assert [e["kind"] for e in await p.entries()] == ["topup"]

    scenario(fake, fresh_pg_database, tmp_path, body)


def test_an_account_a_dispute_left_below_zero_is_refused_and_its_card_not_recharged(fake: FakeStripePayments,
                                                                                     fresh_pg_database: Any, tmp_path: Path) -> None:
    """A $10 top-up, a paid request, then the $10 is charged back: the balance is below zero, and
    the very next request (no housekeeping: the webhook itself tells the limiter) gets OpenAI's 429
    insufficient_quota. Auto-recharge charges no saved card after a chargeback (likely disputed again;
    the same card has another id in each Checkout): recharge_error says why; late events of an
    earlier Checkout save nothing; a new Checkout saves its card, which auto-recharge then uses."""
    async def body(p: Prepaid) -> None:
        disputed = await p.top_up(1000)
        card = fake.payment_intents[disputed]["payment_method"]
        request = {"model": "alpha", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
        r = await p.customer.post("/v1/chat/completions", json=request)
        assert r.status_code == 200, r.text
        await flush_ledger(p.app.app)
        spent = 1000 * CENT - await p.balance()
        assert spent > 0

        await p.deliver(fake.dispute(disputed), "shuffled")
        assert await p.balance() == -spent < 0
        r = await p.customer.post("/v1/chat/completions", json=request)
        assert r.status_code == 429, r.text
        assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("insufficient_quota", "insufficient_quota")

        r = await p.admin.put(f"/admin/accounts/{p.account}/recharge", json={"recharge_below": "100.00", "recharge_amount": "5.00"})
        assert r.status_code == 200, r.text
        r = await p.admin.post("/admin/credits/housekeeping")
        assert r.status_code == 200 and r.json()["recharged"] == [], r.text
        assert not [pi for pi in fake.payment_intents.values() if pi["metadata"].get("tollgate_recharge")]
        state = (await p.admin.get(f"/admin/accounts/{p.account}/credits")).json()["recharge"]
        assert state["payment_method_id"] is None and state["recharge_state"] == "idle", state
        shown = (await p.customer.get("/v1/billing/balance")).json()["recharge"]["recharge_error"]  # saving the setting kept it
        assert "no saved card is charged" in shown and "Stripe dispute (fraudulent)" in shown and disputed in shown, shown
        session = next(sid for sid, s in fake.sessions.items() if s["payment_intent"] == disputed)
        await p.deliver(fake.events_about(session))  # its Checkout's events again (late): no card saved by them
        assert (await p.admin.get(f"/admin/accounts/{p.account}/credits")).json()["recharge"]["payment_method_id"] is None

        fresh = await p.top_up(2000)  # a new card, saved
        state = (await p.admin.get(f"/admin/accounts/{p.account}/credits")).json()["recharge"]
        assert state["payment_method_id"] == fake.payment_intents[fresh]["payment_method"] != card and state["recharge_error"] is None
        r = await p.admin.post("/admin/credits/housekeeping")
        assert r.json()["recharged"] == [p.account], r.text
        charged = [pi for pi in fake.payment_intents.values() if pi["metadata"].get("tollgate_recharge")]
        assert [pi["payment_method"] for pi in charged] == [state["payment_method_id"]]

    scenario(fake, fresh_pg_database, tmp_path, body, alpha=FakeEngine("alpha"))


def test_a_chargeback_heard_before_its_checkout_saves_no_card(fake: FakeStripePayments, fresh_pg_database: Any,
                                                               tmp_path: Path) -> None:
    """Webhooks come in any order and a Checkout's can be retried for days: the chargeback of a top-up
    arrives before the top-up's own events. The top-up is credited and the dispute debited (net
    zero), and the card is not saved: auto-recharge stays stopped, as when the dispute came after. An
    inquiry heard first withdraws nothing and stops no card: that top-up's card is saved."""
    async def body(p: Prepaid) -> None:
        r = await p.admin.put(f"/admin/accounts/{p.account}/recharge", json={"recharge_below": "100.00", "recharge_amount": "5.00"})
        assert r.status_code == 200, r.text

        checkout, disputed = await p.pay(1000)
        opened = fake.dispute(disputed)
        await p.deliver(opened, "shuffled")
        assert await p.balance() == -1000 * CENT
        await p.deliver(checkout, "shuffled")
        assert await p.balance() == 0
        state = (await p.admin.get(f"/admin/accounts/{p.account}/credits")).json()["recharge"]
        assert state["payment_method_id"] is None, state
        assert state["recharge_error"].startswith("auto-recharge stopped after a chargeback") and disputed in state["recharge_error"], state
        r = await p.admin.post("/admin/credits/housekeeping")
        assert r.status_code == 200 and r.json()["recharged"] == [], r.text
        assert not [pi for pi in fake.payment_intents.values() if pi["metadata"].get("tollgate_recharge")]

        checkout, asked = await p.pay(700)
        await p.deliver(fake.dispute(asked, inquiry=True))
        await p.deliver(checkout, "shuffled")
        state = (await p.admin.get(f"/admin/accounts/{p.account}/credits")).json()["recharge"]
        assert state["payment_method_id"] == fake.payment_intents[asked]["payment_method"] and state["recharge_error"] is None, state
        assert await p.balance() == 700 * CENT

    scenario(fake, fresh_pg_database, tmp_path, body)


def test_a_full_amount_dispute_after_a_partial_refund_debits_what_stripe_kept(fake: FakeStripePayments, fresh_pg_database: Any,
                                                                              tmp_path: Path) -> None:
    """A $20 top-up, $5 of it refunded, then the bank disputes the full $20 (Stripe support: it happens;
    the issuer corrects it). Stripe withdraws $20: the account is debited $20 (-$5 with the refund).
    Closed "partially won" (status `lost`, the refunded $5 reinstated: a second balance transaction):
    $5 comes back, so the customer, who got $5 by refund and $15 net by the dispute, ends at zero,
    not at -$5 (the refund taken twice). Events in any order, repeated, give the same rows."""
    async def body(p: Prepaid) -> None:
        paid = await p.top_up(2000)
        await p.deliver(fake.refund(paid, 500))
        assert await p.balance() == 1500 * CENT
        opened = fake.dispute(paid, 2000, "credit_not_processed")
        dispute = opened[0]["data"]["object"]["id"]
        await p.deliver(opened, "shuffled")
        assert await p.balance() == -500 * CENT
        closed = fake.review_dispute(dispute) + fake.close_dispute(dispute, won=False, reinstated=500)
        assert fake.disputes[dispute]["status"] == "lost"
        await p.deliver(closed + opened, "shuffled")
        assert await p.balance() == 0
        assert await p.dispute_rows(dispute) == [(dispute, -2000 * CENT, "refund"), (f"{dispute}:won", 500 * CENT, "refund")]
        reasons = {e["external_id"]: e["reason"] for e in await p.entries()}
        assert reasons[f"{dispute}:won"] == "Stripe dispute (credit_not_processed) partially won: $5.00 reinstated"

    scenario(fake, fresh_pg_database, tmp_path, body)


def test_a_dispute_first_heard_of_already_won_stops_the_card_as_in_order(fake: FakeStripePayments, fresh_pg_database: Any,
                                                                        tmp_path: Path) -> None:
    """Heard in order, a chargeback stops auto-recharge's card at its first event and a later win does not
    bring it back; heard first as won (its earlier events lost or late), the end is the same: net zero,
    and no saved card."""
    async def body(p: Prepaid) -> None:
        paid = await p.top_up(1000)
        assert (await p.admin.get(f"/admin/accounts/{p.account}/credits")).json()["recharge"]["payment_method_id"]
        opened = fake.dispute(paid)
        dispute = opened[0]["data"]["object"]["id"]
        await p.deliver(fake.close_dispute(dispute, won=True), "reversed")
        assert await p.balance() == 1000 * CENT
        state = (await p.admin.get(f"/admin/accounts/{p.account}/credits")).json()["recharge"]
        assert state["payment_method_id"] is None and paid in state["recharge_error"], state

    scenario(fake, fresh_pg_database, tmp_path, body)
