"""Admin API: accounts, keys (secret shown once, stored only as a hash), revocation, usage."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from billing.db import create_engine
from tests.conftest import MODEL, Gateway


async def test_account_and_key_lifecycle(gateway: Gateway, client_for: Any) -> None:
    async with gateway.admin_client() as admin:
        r = await admin.post("/admin/accounts", json={"name": "lifecycle-co"})
        assert r.status_code == 201
        account = r.json()
        assert set(account) >= {"id", "name", "created_at"}
        assert (await admin.post("/admin/accounts", json={"name": "lifecycle-co"})).status_code == 409

        r = await admin.post("/admin/keys", json={"account_id": account["id"], "name": "ci", "models": [MODEL]})
        assert r.status_code == 201
        created = r.json()
        secret = created["key"]
        assert secret.startswith("sk-") and len(secret) >= 3 + 43
        assert created["prefix"] == secret[: len(created["prefix"])]
        assert created["models"] == [MODEL]

        listed = (await admin.get("/admin/keys", params={"account_id": account["id"]})).json()["data"]
        assert [k["id"] for k in listed] == [created["id"]]
        assert all("key" not in k for k in listed)
        assert secret not in (await admin.get(f"/admin/keys/{created['id']}")).text

    resp = await client_for(secret).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    await gateway.ledger_row(resp.id.split("-", 1)[1])

    async with gateway.admin_client() as admin:
        usage = (await admin.get("/admin/usage", params={"account_id": account["id"]})).json()
        assert usage["totals"] == [
            {
                "account_id": account["id"],
                "model": MODEL,
                "requests": 1,
                "prompt_tokens": resp.usage.prompt_tokens,
                "completion_tokens": resp.usage.completion_tokens,
                "total_tokens": resp.usage.total_tokens,
                "cached_tokens": 0,  # the embedded engine reports no prefix-cache hits
            }
        ]
        assert [e["request_id"] for e in usage["entries"]] == [resp.id.split("-", 1)[1]]
        empty = (await admin.get("/admin/usage", params={"account_id": account["id"], "start": "2999-01-01T00:00:00Z"})).json()
        assert empty["totals"] == [] and empty["entries"] == []

        revoked = (await admin.delete(f"/admin/keys/{created['id']}")).json()
        assert revoked["revoked_at"] is not None


async def test_keys_are_stored_only_as_hashes(gateway: Gateway) -> None:
    key = await gateway.new_key()
    db = create_engine(gateway.db_url)
    try:
        async with db.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT * FROM api_keys"))).all()
    finally:
        await db.dispose()
    dumped = repr([tuple(r) for r in rows])
    assert key["key"] not in dumped
    assert key["key"][len(key["prefix"]) :] not in dumped


async def test_customer_keys_get_403_on_admin_api(gateway: Gateway, customer: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, headers={"Authorization": f"Bearer {customer['key']}"}) as c:
        for method, path in [("GET", "/admin/keys"), ("POST", "/admin/accounts"), ("GET", "/admin/usage"), ("DELETE", "/admin/keys/1")]:
            r = await c.request(method, path, json={"name": "x"} if method == "POST" else None)
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["error"]["code"] == "admin_required"
    async with httpx.AsyncClient(base_url=gateway.base_url) as c:
        assert (await c.get("/admin/keys")).status_code == 401


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/admin/accounts", {}, 400),
        ("/admin/accounts", {"name": ""}, 400),
        ("/admin/accounts", {"name": 5}, 400),
        ("/admin/keys", {"account_id": "one"}, 400),
        ("/admin/keys", {"account_id": -3}, 400),
        ("/admin/keys", {"account_id": 999999}, 404),
        ("/admin/keys", {"account_id": 1, "expires_at": "tomorrow"}, 400),
        ("/admin/keys", {"account_id": 1, "models": "all"}, 400),
    ],
)
async def test_admin_input_errors(gateway: Gateway, path: str, body: dict[str, Any], status: int) -> None:
    async with gateway.admin_client() as admin:
        r = await admin.post(path, json=body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_admin_query_errors(gateway: Gateway) -> None:
    async with gateway.admin_client() as admin:
        assert (await admin.get("/admin/keys", params={"account_id": "abc"})).status_code == 400
        assert (await admin.get("/admin/usage", params={"start": "yesterday"})).status_code == 400
        assert (await admin.get("/admin/keys/abc")).status_code == 404
        assert (await admin.delete("/admin/keys/987654")).status_code == 404


async def test_keys_never_appear_in_logs(gateway: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    key = await gateway.new_key()
    wrong = key["key"][:-4] + "AAAA"
    async with httpx.AsyncClient(base_url=gateway.v1) as c:
        await c.post("/chat/completions", headers={"Authorization": f"Bearer {wrong}"}, json={"model": MODEL, "messages": []})
        await c.post("/chat/completions", headers={"Authorization": f"Bearer {key['key']}"}, content=b"{")
        await c.post("/chat/completions", headers={"Authorization": f"Bearer {key['key']}"}, json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    text = caplog.text
    assert key["key"] not in text and wrong not in text


async def test_an_admin_body_field_the_api_does_not_know_is_a_400_naming_it(gateway: Gateway) -> None:
    """A misplaced or mistyped field is refused, not dropped: `limits` given when a key is created
    (limits are set with PATCH /admin/keys/{id}) would otherwise leave the new key unlimited."""
    async with gateway.admin_client() as admin:
        account = (await admin.post("/admin/accounts", json={"name": "strict-bodies"})).json()
        r = await admin.post("/admin/keys", json={"account_id": account["id"], "limits": {"monthly_tokens": 10}})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": "unknown parameter: 'limits'", "type": "invalid_request_error",
                                     "param": "limits", "code": "unknown_parameter"}
        assert (await admin.get("/admin/keys", params={"account_id": account["id"]})).json()["data"] == []  # no key made
        key = (await admin.post("/admin/keys", json={"account_id": account["id"]})).json()
        r = await admin.patch(f"/admin/keys/{key['id']}", json={"limits": {"monthly_tokens": 10}, "limit": {"rpm": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
        r = await admin.post(f"/admin/accounts/{account['id']}/credits", json={"amount": "5", "kind": "grant", "note": "y"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "note", r.text
        r = await admin.patch(f"/admin/keys/{key['id']}", json={"limits": {"monthly_tokens": 10}})
        assert r.status_code == 200 and r.json()["limits"] == {"monthly_tokens": 10}
