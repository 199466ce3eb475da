"""Prepaid credit and spend alerts over HTTP and the CLI (issue 25): the admin API (billing mode,
top-up, grant, refund, adjustment with its reason and admin key, clear 400/404s), the customer's
balance and alerts, an alert webhook to a local receiver fired by the server's own housekeeping,
the customer dashboard showing both; `tollgate credits` on SQLite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx

from billing.alerts.spend import verify
from tests import cli_runner
from tests.billing.invoice_helpers import new_account, new_key, serve
from tests.billing.alerts.test_alerts import Receiver
from tests.conftest import run_coro
from billing.db import create_engine


def test_admin_api_customer_view_alerts_and_dashboard(fresh_pg_database: Any, tmp_path: Path) -> None:
    url = fresh_pg_database(migrated=True)
    with serve(url, tmp_path, TOLLGATE_CREDITS_CHECK_SECONDS="0.2") as app, Receiver() as receiver:
        async def make() -> tuple[int, str]:
            db = create_engine(url)
            try:
                account = await new_account(db, "prepaid-co")
                return account, await new_key(db, account)
            finally:
                await db.dispose()

        account, key = run_coro(make())

        async def scenario() -> None:
            async with app.admin() as admin, app.as_key(key) as customer:
                base = f"/admin/accounts/{account}"
                assert (await admin.put(f"{base}/billing_mode", json={"billing_mode": "prepaid"})).json()["billing_mode"] == "prepaid"
                r = await admin.put(f"{base}/billing_mode", json={"billing_mode": "free"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "billing_mode"
                top = await admin.post(f"{base}/credits", json={"kind": "topup", "amount": "0.50"})
                assert top.status_code == 201 and top.json()["amount_nanos"] == 500_000_000
                expires = (datetime.now(timezone.utc) + timedelta(days=7)).isoformat()
                grant = await admin.post(f"{base}/credits", json={"kind": "grant", "amount": "0.25", "expires_at": expires})
                assert grant.status_code == 201 and grant.json()["expires_at"] is not None
                refund = await admin.post(f"{base}/credits", json={"kind": "refund", "amount": "0.10"})
                assert refund.json()["amount_nanos"] == -100_000_000
                for body, param in (({"kind": "adjustment", "amount": "-0.01"}, "reason"),
                                    ({"kind": "usage", "amount": "1"}, "kind"),
                                    ({"kind": "topup", "amount": "-1"}, "amount"),
                                    ({"kind": "topup", "amount": 1.5}, "amount"),
                                    ({"kind": "topup", "amount": "1", "expires_at": expires}, "expires_at")):
                    r = await admin.post(f"{base}/credits", json=body)
                    assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
                adj = await admin.post(f"{base}/credits", json={"kind": "adjustment", "amount": "-0.01", "reason": "typo in top-up"})
                assert adj.status_code == 201 and adj.json()["reason"] == "typo in top-up" and adj.json()["admin_key_id"] is not None
                assert (await admin.post("/admin/accounts/999999/credits", json={"kind": "topup", "amount": "1"})).status_code == 404
                assert (await customer.post(f"{base}/credits", json={"kind": "topup", "amount": "1"})).status_code == 403

                listed = (await admin.get(f"{base}/credits")).json()
                assert listed["balance"] == "0.640000000" and [e["kind"] for e in listed["entries"]] == ["adjustment", "refund", "grant", "topup"]
                statement = (await customer.get("/v1/billing/statement")).json()  # this month, a prepaid statement
                assert (statement["opening_balance"], statement["closing_balance"], statement["amount_due"]) == ("0.000000000", "0.640000000", "0.00")
                assert [c["kind"] for c in statement["credits"]] == ["topup", "grant", "refund", "adjustment"]
                bad_period = await customer.get("/v1/billing/statement", params={"period": "2026-13"})
                assert bad_period.status_code == 400 and bad_period.json()["error"]["param"] == "period"
                mine = (await customer.get("/v1/billing/balance")).json()
                assert (mine["balance_nanos"], mine["grants"][0]["remaining"]) == (640_000_000, "0.250000000")

                rule = await admin.post(f"{base}/alerts", json={"metric": "balance_below", "threshold": "1.00", "url": receiver.url})
                assert rule.status_code == 201 and rule.json()["secret"].startswith("whsec_tg_")
                bad = await admin.post(f"{base}/alerts", json={"metric": "monthly_tokens", "threshold": "1.5", "url": receiver.url})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "threshold"
                deadline = time.monotonic() + 30
                while not receiver.seen and time.monotonic() < deadline:  # the server's housekeeping runs every 0.2 s
                    await customer.get("/v1/billing/alerts")
                events = (await customer.get("/v1/billing/alerts")).json()
                assert len(receiver.seen) == 1 and len(events["data"]) == 1 and "secret" not in events["rules"][0]
                body, header = receiver.seen[0]
                assert verify(rule.json()["secret"], body, header)
                assert json.loads(body)["message"] == f"The prepaid balance of account {account} is $0.640000000, below $1.000000000."

            async with httpx.AsyncClient(base_url=app.base_url, timeout=30, headers={"origin": app.base_url}) as browser:
                form = (await browser.get("/dashboard/login")).text
                csrf = re.search(r'name="csrf_token" value="([^"]+)"', form).group(1)  # type: ignore[union-attr]
                assert (await browser.post("/dashboard/login", data={"csrf_token": csrf, "api_key": key})).status_code == 303
                html = (await browser.get("/dashboard/account")).text
            assert '<strong id="credit-balance">$0.640000000</strong>' in html
            assert "below $1.000000000" in html

        run_coro(scenario())


def tollgate(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "TOLLGATE_SECRET", "REDIS_URL")}
    env["TOLLGATE_DATA_DIR"] = str(data_dir)
    return cli_runner.tollgate(args, env)


def test_cli_on_sqlite(tmp_path: Path) -> None:
    assert tollgate(tmp_path, "migrate").returncode == 0
    assert tollgate(tmp_path, "accounts", "create", "acme").returncode == 0
    assert json.loads(tollgate(tmp_path, "credits", "mode", "--account", "acme", "prepaid").stdout)["billing_mode"] == "prepaid"
    added = tollgate(tmp_path, "credits", "add", "--account", "acme", "--kind", "topup", "--amount", "12.345678901")
    assert json.loads(added.stdout)["amount_nanos"] == 12_345_678_901
    missing_reason = tollgate(tmp_path, "credits", "add", "--account", "acme", "--kind", "adjustment", "--amount", "-1")
    assert missing_reason.returncode == 1 and "needs a reason" in missing_reason.stderr
    assert tollgate(tmp_path, "credits", "add", "--account", "acme", "--kind", "adjustment", "--amount", "-0.345678901",
                    "--reason", "correction").returncode == 0
    balance = json.loads(tollgate(tmp_path, "credits", "balance", "--account", "acme").stdout)
    assert balance["balance"] == "12.000000000" and len(balance["entries"]) == 2
    nobody = tollgate(tmp_path, "credits", "balance", "--account", "nobody")
    assert nobody.returncode == 1 and "no account named 'nobody'" in nobody.stderr
    assert tollgate(tmp_path, "credits", "post").returncode == 0
