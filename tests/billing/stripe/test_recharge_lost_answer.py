"""An auto-recharge whose create got no answer from Stripe (billing/stripe/checkout.py): the real
CheckoutService on Postgres, the official SDK against the FAKE Stripe (tests/fakes/stripe_checkout.py,
which replays an idempotency key's stored result as Stripe does). The create fails after the SDK's
retries, either after Stripe ran it (the connection drops: the intent exists) or before (a 500: it
does not); RESEND_AFTER later recharge_due sends it again with the same key and parameters, which
ends with one PaymentIntent and one credit. A claim older than Stripe keeps its keys is never sent
again: it is `failed`, for a person."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from stripe import StripeClient

from billing import migrate
from billing.credits.balance import CreditBook
from billing.db import create_engine
from billing.keys.store import KeyStore
from billing.models import utcnow
from billing.stripe import checkout
from billing.stripe.checkout import RESEND_AFTER, CheckoutService
from tests.billing.stripe.test_checkout import fake  # noqa: F401  (the fixture)
from tests.conftest import SECRET, run_coro
from tests.fakes.stripe_checkout import FakeStripePayments

CENT = 10_000_000
INTENTS = r"/v1/payment_intents"


async def _pay_checkout(service: CheckoutService, fake: FakeStripePayments, db: Any, account: int, cents: int) -> None:
    """A Checkout paid by card (the card is saved), its `checkout.session.completed` applied."""
    session = await service.create_session(account, cents, success_url="https://example.com/ok", cancel_url="https://example.com/no")
    events = fake.complete_session(session["id"])
    completed = next(e for e in events if e["type"] == "checkout.session.completed")
    apply = await service.webhook_handlers()["checkout.session.completed"](completed["data"]["object"])
    assert apply is not None
    async with db.begin() as conn:
        await apply(conn)


async def _setup(url: str, fake: FakeStripePayments) -> tuple[Any, CheckoutService, CreditBook, int]:
    db = create_engine(url)
    account = int((await KeyStore(db, SECRET.encode()).create_account("rc-" + uuid.uuid4().hex[:6]))["id"])
    book = CreditBook(db)
    await book.set_mode(account, "prepaid")
    client = StripeClient(fake.api_key, base_addresses={"api": fake.url}, max_network_retries=2)  # type: ignore[arg-type]
    service = CheckoutService(db, client, book)
    await _pay_checkout(service, fake, db, account, 1000)  # $10, the card saved
    await service.set_recharge(account, 12 * 100 * CENT, 500)  # below $12: charge $5 (then $15: no more)
    return db, service, book, account


def _recharges(fake: FakeStripePayments) -> list[dict[str, Any]]:
    return [pi for pi in fake.payment_intents.values() if pi["metadata"].get("tollgate_recharge")]


@pytest.mark.parametrize("stored", [True, False], ids=["stored-at-stripe", "not-stored"])
def test_a_recharge_whose_answer_was_lost_is_sent_again_and_credited_once(fake: FakeStripePayments, fresh_pg_database: Any,
                                                                         stored: bool) -> None:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)

    async def scenario() -> None:
        db, service, book, account = await _setup(url, fake)
        try:
            assert await service.recharge_due() == [account]  # an earlier recharge, answered: $15
            [earlier] = _recharges(fake)
            await service.set_recharge(account, 18 * 100 * CENT, 500)  # below $18 now: the next one is due
            # status 0: Stripe ran the create, the connection dropped (and on the SDK's two retries, replayed);
            # 500: nothing ran (no idempotent result is saved before an endpoint executes)
            fake.fail("POST", INTENTS, status=0 if stored else 500, times=3)
            sent = fake.count("POST", INTENTS)
            assert await service.recharge_due() == []
            state = await service.settings(account)
            assert state["recharge_state"] == "pending" and state["recharge_payment_intent"] is None, state
            assert len(_recharges(fake)) == (2 if stored else 1)
            assert fake.count("POST", INTENTS) == sent + 3

            assert await service.recharge_due(now=utcnow() + RESEND_AFTER / 2) == []  # too soon: its webhook may still come
            assert fake.count("POST", INTENTS) == sent + 3

            assert await service.recharge_due(now=utcnow() + RESEND_AFTER + timedelta(seconds=1)) == [account]
            [_, intent] = _recharges(fake)
            assert intent["status"] == "succeeded" and intent["amount"] == 500 and intent["metadata"]["tollgate_recharge"] == "2"
            keys = [key for method, path, key, _ in fake.requests if method == "POST" and path == INTENTS][1:]
            assert set(keys) == {f"tollgate-recharge-{account}-2"} and len(keys) == 4  # every send, the same key
            state = await service.settings(account)
            assert state["recharge_state"] == "idle" and state["recharge_payment_intent"] == intent["id"], state
            entries = await book.entries(account)
            assert sorted(e["external_id"] for e in entries if e["amount_nanos"] == 500 * CENT) == sorted([earlier["id"], intent["id"]])
            assert len(entries) == 3 and (await book.balance(account))["balance_nanos"] == 2000 * CENT  # type: ignore[index]

            later = utcnow() + RESEND_AFTER * 3  # nothing more: above the threshold, nothing lost
            assert await service.recharge_due(now=later) == []
            assert len(_recharges(fake)) == 2 and len(await book.entries(account)) == 3
        finally:
            await db.dispose()

    run_coro(scenario())


def test_a_lost_recharge_older_than_stripes_idempotency_window_fails_without_a_create(
        fake: FakeStripePayments, fresh_pg_database: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)

    async def scenario() -> None:
        db, service, book, account = await _setup(url, fake)
        try:
            fake.fail("POST", INTENTS, status=0, times=3)  # the charge ran at Stripe; its answer was lost
            claimed = utcnow()
            assert await service.recharge_due() == []
            assert (await service.settings(account))["recharge_state"] == "pending"
            [intent] = _recharges(fake)

            # 20 hours on, the customer pays another Checkout: the claim's age is still counted from its claim
            real = checkout.utcnow
            monkeypatch.setattr(checkout, "utcnow", lambda: real() + timedelta(hours=20))
            await _pay_checkout(service, fake, db, account, 100)
            monkeypatch.setattr(checkout, "utcnow", real)

            fake.forget_idempotency_keys()  # what 24 hours do at Stripe: the same key would charge again
            sent = fake.count("POST", INTENTS)
            assert await service.recharge_due(now=claimed + timedelta(hours=25)) == []
            assert fake.count("POST", INTENTS) == sent and _recharges(fake) == [intent]  # nothing sent
            state = await service.settings(account)
            assert state["recharge_state"] == "failed" and state["recharge_payment_intent"] is None, state
            assert "Stripe dashboard" in state["recharge_error"] and "tollgate_recharge=1" in state["recharge_error"], state
            assert await service.recharge_due(now=claimed + timedelta(hours=26)) == []  # failed stays failed
            assert fake.count("POST", INTENTS) == sent
            async with db.connect() as conn:  # nothing credited for the lost charge
                credited = (await conn.execute(sa.select(checkout.CREDITS.c.external_id).where(
                    checkout.CREDITS.c.account_id == account))).scalars().all()
            assert intent["id"] not in credited and len(credited) == 2
        finally:
            await db.dispose()

    run_coro(scenario())


def test_a_settings_change_while_a_charge_is_pending_charges_the_card_once(fake: FakeStripePayments, fresh_pg_database: Any) -> None:
    """The claim's charge ran at Stripe, its answer was lost; then the account's auto-recharge is set
    again (a new amount). The claim stays pending: no second charge for the same crossing, and the
    create sent again carries the claim's amount (its key's parameters), not the new one."""
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)

    async def scenario() -> None:
        db, service, book, account = await _setup(url, fake)
        try:
            fake.fail("POST", INTENTS, status=0, times=3)  # charged at Stripe, no answer
            assert await service.recharge_due() == []
            [first] = _recharges(fake)
            sent = fake.count("POST", INTENTS)

            state = await service.set_recharge(account, 20 * 100 * CENT, 700)  # below $20 now, $7 a charge
            assert state["recharge_state"] == "pending" and state["recharge_amount_cents"] == 700, state
            assert await service.recharge_due() == []  # the pending claim is this crossing's charge
            assert fake.count("POST", INTENTS) == sent and _recharges(fake) == [first]

            assert await service.recharge_due(now=utcnow() + RESEND_AFTER + timedelta(seconds=1)) == [account]
            assert [pi["id"] for pi in _recharges(fake)] == [first["id"]]  # Stripe replayed the key's result
            assert first["amount"] == 500 and (await book.balance(account))["balance_nanos"] == 1500 * CENT  # type: ignore[index]
            assert (await service.settings(account))["recharge_state"] == "idle"

            assert await service.recharge_due() == [account]  # $15 < $20: the next charge, at the new amount
            assert [pi["amount"] for pi in _recharges(fake)] == [500, 700]
            assert (await book.balance(account))["balance_nanos"] == 2200 * CENT  # type: ignore[index]
        finally:
            await db.dispose()

    run_coro(scenario())
