"""GET /v1/usage through real requests: sums match the ledger, grouping, own account only,
admin may choose an account, OpenAI-shaped errors."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import sqlalchemy as sa

from billing.db import create_engine
from tests.conftest import MODEL, Gateway


async def chat(client: Any, text: str, max_tokens: int = 4) -> Any:
    return await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0
    )


async def ledger_totals(gw: Gateway, account_id: int) -> dict[str, int]:
    db = create_engine(gw.db_url)
    try:
        async with db.connect() as conn:
            row = (await conn.execute(sa.text(
                "SELECT count(*) AS n, sum(prompt_tokens) AS p, sum(completion_tokens) AS c FROM ledger_entries"
                " WHERE account_id = :a"), {"a": account_id})).one()
        return {"requests": int(row.n), "prompt_tokens": int(row.p or 0), "completion_tokens": int(row.c or 0)}
    finally:
        await db.dispose()


def get(gw: Gateway, key: str, **params: Any) -> httpx.Response:
    return httpx.get(gw.v1 + "/usage", params=params, headers={"Authorization": f"Bearer {key}"}, timeout=30)


async def test_usage_matches_the_ledger_and_stays_in_the_account(gateway: Gateway, client_for: Any) -> None:
    first = await gateway.new_key(name="first")
    second = await gateway.new_key(first["account_id"], name="second")
    stranger = await gateway.new_key()
    ids = []
    for key, text in ((first, "Say hi."), (first, "Count to three."), (second, "Name a color."), (stranger, "Hello")):
        raw = await chat(client_for(key["key"]), text)
        ids.append(raw.headers["x-request-id"])
    for rid in ids:
        await gateway.ledger_row(rid)
    await gateway.app.state.ledger.flush(timeout=10)

    truth = await ledger_totals(gateway, first["account_id"])
    assert truth["requests"] == 3
    body = get(gateway, first["key"], group_by="model").json()
    assert body["object"] == "usage" and body["account_id"] == first["account_id"]
    [by_model] = body["data"]
    assert by_model["model"] == MODEL
    assert {k: by_model[k] for k in truth} == truth
    assert body["totals"]["total_tokens"] == truth["prompt_tokens"] + truth["completion_tokens"]

    by_key = get(gateway, second["key"], group_by="key").json()["data"]
    assert sorted((r["key_id"], r["requests"]) for r in by_key) == sorted([(first["id"], 2), (second["id"], 1)])
    assert {r["key_prefix"] for r in by_key} == {first["prefix"], second["prefix"]}
    assert all(first["key"] not in str(r) for r in by_key)

    today = datetime.now(timezone.utc).date().isoformat()
    by_day_model = get(gateway, first["key"], group_by="day,model").json()["data"]
    assert [(r["day"], r["model"], r["requests"]) for r in by_day_model] == [(today, MODEL, 3)]

    # The stranger sees only its own request, and may not name another account.
    mine = get(gateway, stranger["key"]).json()
    assert mine["totals"]["requests"] == 1
    refused = get(gateway, stranger["key"], account_id=first["account_id"])
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "account_not_allowed"

    # The admin sees any account, or all of them.
    admin = get(gateway, gateway.admin_key, account_id=first["account_id"], group_by="key").json()
    assert sum(r["requests"] for r in admin["data"]) == 3
    everyone = get(gateway, gateway.admin_key).json()
    assert everyone["account_id"] is None and everyone["totals"]["requests"] >= 4


async def test_period_and_errors(gateway: Gateway, customer: dict[str, Any]) -> None:
    key = customer["key"]
    past = get(gateway, key, start="2020-01-01", end="2020-02-01").json()
    assert past["data"] == [] and past["totals"]["requests"] == 0
    assert past["start"].startswith("2020-01-01T00:00:00") and past["end"].startswith("2020-02-01T00:00:00")
    start = int((datetime.now(timezone.utc) - timedelta(hours=2)).timestamp())
    assert get(gateway, key, start=str(start)).status_code == 200
    for params, param in (
        ({"group_by": "week"}, "group_by"),
        ({"group_by": "day,day"}, "group_by"),
        ({"start": "yesterday"}, "start"),
        ({"start": "2026-02-01", "end": "2026-01-01"}, "start"),
        ({"start": "2000-01-01", "end": "2026-01-01"}, "end"),
        ({"account_id": "x"}, "account_id"),
    ):
        r = get(gateway, key, **params)
        assert r.status_code == 400, (params, r.text)
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(gateway.v1 + "/usage", timeout=30)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    bad = get(gateway, "sk-" + "x" * 40)
    assert bad.status_code == 401 and "x" * 40 not in bad.text
