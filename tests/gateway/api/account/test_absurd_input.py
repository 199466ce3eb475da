"""Absurd but well-formed input over HTTP, through the real app (tests/billing/invoice_helpers.serve) and
the FAKE Stripe: an amount like "1e999999", the month 9999-12 and instants at the ends of datetime's
range each get a 400 in OpenAI's error shape naming the field, never a 500, and the next normal
request is served."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx

from billing.db import create_engine
from billing.keys.store import KeyStore
from tests.billing.invoice_helpers import serve
from tests.billing.stripe.test_checkout import fake, stripe_env  # noqa: F401  (fake: the fixture)
from tests.conftest import SECRET, run_coro
from tests.fakes.stripe_checkout import FakeStripePayments


def account_and_key(url: str) -> tuple[int, dict[str, Any]]:
    async def make() -> tuple[int, dict[str, Any]]:
        db = create_engine(url)
        try:
            keys = KeyStore(db, SECRET.encode())
            account = (await keys.create_account("absurd-" + uuid.uuid4().hex[:6]))["id"]
            return int(account), await keys.create_key(account)
        finally:
            await db.dispose()

    return run_coro(make())


def refused(r: httpx.Response, param: str) -> None:
    """A 400 in OpenAI's error shape naming `param`."""
    assert r.status_code == 400, (param, r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


HUGE = ("1e999999", "-1e999999", "1e1000000", "9007199.254740992")


def test_absurd_money_amounts_are_a_400_naming_the_field(fake: FakeStripePayments, fresh_pg_database: Any, tmp_path: Path) -> None:
    url = fresh_pg_database(migrated=True)
    account, key = account_and_key(url)
    with serve(url, tmp_path, **stripe_env(fake)) as app:
        async def scenario() -> None:
            async with app.admin() as admin, app.as_key(key["key"]) as customer:
                base = f"/admin/accounts/{account}"
                assert (await admin.put(f"{base}/billing_mode", json={"billing_mode": "prepaid"})).status_code == 200
                for huge in HUGE:
                    refused(await customer.post("/v1/billing/checkout", json={"amount": huge}), "amount")
                    for kind in ("grant", "topup", "refund", "adjustment"):
                        refused(await admin.post(f"{base}/credits", json={"kind": kind, "amount": huge, "reason": "r"}), "amount")
                    refused(await admin.put(f"{base}/recharge", json={"recharge_below": huge, "recharge_amount": "20.00"}),
                            "recharge_below")
                    refused(await admin.put(f"{base}/recharge", json={"recharge_below": "5.00", "recharge_amount": huge}),
                            "recharge_amount")
                    for metric in ("monthly_spend", "balance_below"):
                        refused(await admin.post(f"{base}/alerts", json={"metric": metric, "threshold": huge, "url": "https://example.com/h"}),
                                "threshold")
                    refused(await admin.patch(f"/admin/keys/{key['id']}", json={"limits": {"monthly_spend": huge}}), "limits.monthly_spend")
                    refused(await admin.patch(base, json={"limits": {"monthly_spend": huge}}), "limits.monthly_spend")

                # The server keeps serving, and the largest amount the ledger holds is still taken, to the nano.
                r = await customer.post("/v1/billing/checkout", json={"amount": "12.34"})
                assert r.status_code == 200 and r.json()["amount_cents"] == 1234, r.text
                r = await admin.post(f"{base}/credits", json={"kind": "grant", "amount": "9007199.254740991"})
                assert r.status_code == 201 and r.json()["amount_nanos"] == 2**53 - 1, r.text
                r = await admin.put(f"{base}/recharge", json={"recharge_below": "5.00", "recharge_amount": "20.00"})
                assert r.status_code == 200 and r.json()["recharge_below_nanos"] == 5_000_000_000, r.text
                r = await admin.post(f"{base}/alerts", json={"metric": "balance_below", "threshold": "1.00", "url": "https://example.com/h"})
                assert r.status_code == 201 and r.json()["threshold"] == 1_000_000_000, r.text
                r = await admin.patch(f"/admin/keys/{key['id']}", json={"limits": {"monthly_spend": "25.00"}})
                assert r.status_code == 200 and r.json()["limits"]["monthly_spend"] == "25.00", r.text
                assert (await customer.get("/v1/billing/balance")).json()["balance_nanos"] == 2**53 - 1

        run_coro(scenario())


def test_the_month_9999_12_is_a_400_naming_the_period(fresh_pg_database: Any, tmp_path: Path) -> None:
    url = fresh_pg_database(migrated=True)
    account, key = account_and_key(url)
    with serve(url, tmp_path) as app:
        async def scenario() -> None:
            async with app.admin() as admin, app.as_key(key["key"]) as customer:
                assert (await admin.put(f"/admin/accounts/{account}/billing_mode", json={"billing_mode": "prepaid"})).status_code == 200
                for _ in range(2):
                    refused(await customer.get("/v1/billing/statement", params={"period": "9999-12"}), "period")
                    refused(await admin.get("/admin/invoices", params={"period": "9999-12"}), "period")
                    refused(await admin.get("/admin/statements", params={"period": "9999-12"}), "period")
                    refused(await admin.get(f"/admin/accounts/{account}/statement", params={"period": "9999-12"}), "period")
                    refused(await admin.get("/admin/billing/periods/9999-12"), "period")
                    refused(await admin.post("/admin/invoices/close", json={"period": "9999-12"}), "period")
                # The last month that ends before the year 10000 is still one; and the server keeps serving.
                last = await customer.get("/v1/billing/statement", params={"period": "9999-11"})
                assert last.status_code == 200 and last.json()["end"].startswith("9999-12-01T00:00:00"), last.text
                assert (await admin.get("/admin/invoices", params={"period": "2026-01"})).json()["data"] == []
                assert (await customer.get("/v1/billing/statement")).status_code == 200

        run_coro(scenario())


def test_usage_times_at_the_ends_of_the_calendar_are_a_400_naming_the_parameter(fresh_pg_database: Any, tmp_path: Path) -> None:
    url = fresh_pg_database(migrated=True)
    _, key = account_and_key(url)
    with serve(url, tmp_path) as app:
        async def scenario() -> None:
            async with app.as_key(key["key"]) as customer, app.admin() as admin:
                for params, param in (
                    ({"start": "9999-12-31T23:10:00", "end": "9999-12-31T23:30:00"}, "start"),
                    ({"start": "2026-01-01T00:00:00", "end": "9999-12-31T23:30:00"}, "end"),
                    ({"end": "9999-12-31T23:59:59.999999+00:00"}, "end"),
                    ({"end": "9999-12-31T23:59:59-01:00"}, "end"),
                    ({"start": "0001-01-01T00:00:00+01:00"}, "start"),
                    ({"start": "0001-01-01T00:00:00+01:00", "end": "0001-01-02T00:00:00"}, "start"),
                    ({"end": "0001-01-05T00:00:00"}, "end"),
                ):
                    refused(await customer.get("/v1/usage", params=params), param)
                    refused(await admin.get("/admin/usage", params=params), param)  # the admin's ledger rows, read as /v1/usage does
                ok = await customer.get("/v1/usage", params={"start": "2020-01-01", "end": "2020-02-01"})
                assert ok.status_code == 200 and ok.json()["totals"]["requests"] == 0, ok.text
                assert ok.json()["start"].startswith("2020-01-01T00:00:00") and ok.json()["end"].startswith("2020-02-01T00:00:00")
                assert (await customer.get("/v1/usage")).status_code == 200
                rows = await admin.get("/admin/usage", params={"start": "2020-01-01", "end": "2020-02-01"})
                assert rows.status_code == 200 and rows.json()["entries"] == [], rows.text

        run_coro(scenario())
