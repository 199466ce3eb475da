"""Dashboard sessions and CSRF over plain HTTP: cookie flags, tokens on every POST, customer keys
kept out of the console, logout and revocation end sessions, secrets shown once."""

from __future__ import annotations

import re
import uuid
from typing import Any

import anthropic
import httpx

from tests.conftest import MODEL, Gateway, run_coro, until

TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')


def browser(gw: Gateway) -> httpx.Client:
    return httpx.Client(base_url=gw.base_url, follow_redirects=False, timeout=30)


def log_in(gw: Gateway, key: str) -> tuple[httpx.Client, str]:
    """A logged-in client and its session's CSRF token."""
    c = browser(gw)
    form = c.get("/dashboard/login")
    r = c.post("/dashboard/login", data={"csrf_token": TOKEN.search(form.text).group(1), "api_key": key})
    assert r.status_code == 303, r.text
    page = c.get("/dashboard/admin/accounts" if key == gw.admin_key else "/dashboard/account")
    assert page.status_code == 200
    return c, TOKEN.search(page.text).group(1)


def test_login_needs_its_token_and_sets_a_strict_cookie(gateway: Gateway) -> None:
    c = browser(gateway)
    assert c.post("/dashboard/login", data={"api_key": gateway.admin_key}).status_code == 403
    form = c.get("/dashboard/login")
    assert form.headers["cache-control"] == "no-store" and "frame-ancestors 'none'" in form.headers["content-security-policy"]
    token = TOKEN.search(form.text).group(1)
    forged = c.post("/dashboard/login", data={"csrf_token": token + "x", "api_key": gateway.admin_key})
    assert forged.status_code == 403 and "tollgate_session" not in c.cookies
    token = TOKEN.search(forged.text).group(1)  # every form rendered carries a fresh token
    wrong = c.post("/dashboard/login", data={"csrf_token": token, "api_key": "sk-" + "y" * 43})
    assert wrong.status_code == 401 and "y" * 43 not in wrong.text and "tollgate_session" not in c.cookies
    token = TOKEN.search(wrong.text).group(1)
    ok = c.post("/dashboard/login", data={"csrf_token": token, "api_key": gateway.admin_key})
    assert ok.status_code == 303 and ok.headers["location"] == "/dashboard"
    cookie = next(h for h in ok.headers.get_list("set-cookie") if h.startswith("tollgate_session="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert gateway.admin_key not in cookie


def test_a_nul_in_a_form_field_is_a_400_page_and_stores_nothing(gateway: Gateway) -> None:
    """No column takes a NUL: the account's name was a 500 (JSON, a traceback in the log), a key's
    models were stored with it. Now the form is refused with a page naming the field, urlencoded or
    multipart, and nothing is stored."""
    c, token = log_in(gateway, gateway.admin_key)
    account = c.post("/dashboard/admin/accounts", data={"name": f"nul-{uuid.uuid4().hex[:6]}", "csrf_token": token})
    account_url = account.headers["location"]
    account_id = int(account_url.rsplit("/", 1)[1])
    name = f"a\x00b-{uuid.uuid4().hex[:6]}"
    for path, data in (("/dashboard/admin/accounts", {"name": name}),
                       (f"/dashboard/admin/accounts/{account_id}/keys", {"name": "a\x00b"}),
                       (f"/dashboard/admin/accounts/{account_id}/keys", {"name": "k", "models": f"{MODEL}\x00x"})):
        for multipart in (False, True):
            fields = {**data, "csrf_token": token}
            r = c.post(path, files={k: (None, v) for k, v in fields.items()}) if multipart else c.post(path, data=fields)
            assert r.status_code == 400 and "NUL" in r.text and r.headers["content-type"].startswith("text/html"), (path, r.status_code, r.text[:200])
    assert "data-key-id" not in c.get(account_url).text  # no key was made
    assert name.split("\x00")[1] not in c.get("/dashboard/admin/accounts").text


def test_a_form_past_what_any_page_sends_is_refused_before_it_is_read(gateway: Gateway) -> None:
    """A form body is read up to 64 KiB and 64 fields, then refused with a 413 page, on the login
    (no session needed) and on every logged-in form. Starlette's parser alone took 1,000 fields of
    1 MB: a ~1 GB login POST held ~1 GB of the server's memory before its CSRF check said 403."""
    form = browser(gateway).get("/dashboard/login")
    token = TOKEN.search(form.text).group(1)
    c, session_token = log_in(gateway, gateway.admin_key)

    def chunked(size: int) -> Any:  # no Content-Length: the limit is on what arrives
        yield b"api_key=" + b"x" * (size - 8)

    for path, fields in (("/dashboard/login", {"csrf_token": token}), ("/dashboard/admin/accounts", {"csrf_token": session_token})):
        client = browser(gateway) if path == "/dashboard/login" else c
        if path == "/dashboard/login":
            client.cookies.update(form.cookies)
        big = client.post(path, data={**fields, "api_key": "x" * (1 << 20)})
        many = client.post(path, data={**fields, **{f"f{i}": "1" for i in range(64)}})
        streamed = client.post(path, content=chunked(70_000), headers={"content-type": "application/x-www-form-urlencoded"})
        for r in (big, many, streamed):
            assert r.status_code == 413 and "larger than any page sends" in r.text, (path, r.status_code, r.text[:200])
    ok = c.post("/dashboard/admin/accounts", data={"name": f"fits-{uuid.uuid4().hex[:6]}", "csrf_token": session_token})
    assert ok.status_code == 303  # a form of the usual size still goes through


def test_a_request_with_two_session_cookies_has_no_session(gateway: Gateway) -> None:
    """Cookie tossing: a page on a sibling subdomain (or another port of the host, or a plain-http
    answer) sets its own session cookie for the parent domain, so the browser sends two. Which one a
    parser keeps is no proof of whose browser it is: with two, neither counts (over https the cookie
    is also `__Host-` named, which a browser takes from no other host)."""
    attacker, _ = log_in(gateway, gateway.admin_key)
    victim, _ = log_in(gateway, gateway.admin_key)
    tossed = attacker.cookies["tollgate_session"]
    own = victim.cookies["tollgate_session"]
    for cookies in (f"tollgate_session={own}; tollgate_session={tossed}", f"tollgate_session={tossed}; tollgate_session={own}"):
        r = browser(gateway).get("/dashboard/admin/accounts", headers={"cookie": cookies})
        assert r.status_code == 303 and r.headers["location"] == "/dashboard/login", (cookies, r.status_code)
    assert browser(gateway).get("/dashboard/admin/accounts", headers={"cookie": f"tollgate_session={own}"}).status_code == 200


def test_every_post_needs_the_session_token(gateway: Gateway) -> None:
    c, token = log_in(gateway, gateway.admin_key)
    name = f"csrf-{uuid.uuid4().hex[:6]}"
    for data, headers in (
        ({"name": name}, {}),
        ({"name": name, "csrf_token": "forged"}, {}),
        ({"name": name, "csrf_token": token}, {"origin": "http://evil.example"}),
    ):
        r = c.post("/dashboard/admin/accounts", data=data, headers=headers)
        assert r.status_code == 403 and "security token" in r.text
    assert name not in c.get("/dashboard/admin/accounts").text
    made = c.post("/dashboard/admin/accounts", data={"name": name, "csrf_token": token})
    assert made.status_code == 303
    account_url = made.headers["location"]
    account_id = int(account_url.rsplit("/", 1)[1])
    # Another session's token does not work here either.
    _, other_token = log_in(gateway, gateway.admin_key)
    assert c.post(f"/dashboard/admin/accounts/{account_id}/keys", data={"csrf_token": other_token}).status_code == 403
    created = c.post(f"/dashboard/admin/accounts/{account_id}/keys", data={"csrf_token": token, "name": "k"})
    assert created.status_code == 201
    secret = re.search(r'id="new-key-secret">(sk-[^<]+)<', created.text).group(1)
    assert created.headers["cache-control"] == "no-store"
    assert secret not in c.get(account_url).text  # shown once
    key_id = int(re.search(r'data-key-id="(\d+)"', c.get(account_url).text).group(1))
    assert c.post(f"/dashboard/admin/keys/{key_id}/revoke", data={}).status_code == 403
    assert "revoked" not in c.get(account_url).text


async def test_customer_keys_stay_out_of_the_console(gateway: Gateway, customer: dict[str, Any]) -> None:
    c, token = log_in(gateway, customer["key"])
    assert c.get("/dashboard").headers["location"] == "/dashboard/account"
    for path in ("/dashboard/admin", "/dashboard/admin/accounts", f"/dashboard/admin/accounts/{customer['account_id']}"):
        r = c.get(path)
        assert r.status_code == 403 and "Admins only" in r.text
    r = c.post("/dashboard/admin/accounts", data={"name": "sneaky", "csrf_token": token})
    assert r.status_code == 403
    r = c.post(f"/dashboard/admin/keys/{customer['id']}/revoke", data={"csrf_token": token})
    assert r.status_code == 403
    async with gateway.admin_client() as admin:
        assert (await admin.get(f"/admin/keys/{customer['id']}")).json()["revoked_at"] is None
    # Its session reads only its own usage.
    assert c.get("/v1/usage").json()["account_id"] == customer["account_id"]
    assert c.get("/v1/usage", params={"account_id": customer["account_id"] + 1000}).status_code == 403


def test_logout_ends_the_session(gateway: Gateway) -> None:
    c, token = log_in(gateway, gateway.admin_key)
    stolen = c.cookies["tollgate_session"]
    assert c.post("/dashboard/logout", data={}).status_code == 403  # logout is a form too
    out = c.post("/dashboard/logout", data={"csrf_token": token})
    assert out.status_code == 303 and out.headers["location"] == "/dashboard/login"
    assert any(h.startswith('tollgate_session=""') or "Max-Age=0" in h for h in out.headers.get_list("set-cookie"))
    replay = browser(gateway)
    replay.cookies.set("tollgate_session", stolen)
    r = replay.get("/dashboard/admin")
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
    assert replay.get("/v1/usage").status_code == 401
    assert replay.post("/dashboard/admin/accounts", data={"name": "x", "csrf_token": token}).status_code == 303


def test_behind_a_tls_proxy_the_public_url_makes_cookies_secure_and_its_origin_same(
    engine: Any, fresh_pg_database: Any, tmp_path: Any
) -> None:
    """A proxy in front terminates TLS, so the server sees http: with TOLLGATE_PUBLIC_URL the session
    cookie is Secure and `__Host-` named, a POST from the public origin passes the same-origin check (another origin does
    not), and a message batch's results_url names the public origin."""
    from tests.conftest import start_gateway, stop_server

    public = "https://tollgate.example"
    server, gw = start_gateway(fresh_pg_database(migrated=True), engine, tmp_path, http={"public_url": public})
    try:
        c = browser(gw)

        def as_the_proxy_forwards(response: httpx.Response) -> None:
            """The browser sends a Secure cookie to the proxy over TLS, which forwards it; httpx, on plain
            http here, would keep it to itself: carried by hand."""
            for name, value in response.cookies.items():
                c.cookies.set(name, value)

        form = c.get("/dashboard/login")
        assert all("Secure" in h for h in form.headers.get_list("set-cookie")), form.headers.get_list("set-cookie")
        as_the_proxy_forwards(form)
        ok = c.post("/dashboard/login", data={"csrf_token": TOKEN.search(form.text).group(1), "api_key": gw.admin_key},
                    headers={"origin": public})
        assert ok.status_code == 303, ok.text
        # `__Host-`: a browser takes it only from this host (Secure, Path=/, no Domain), so a sibling
        # subdomain cannot plant its own session (cookie tossing)
        cookie = next(h for h in ok.headers.get_list("set-cookie") if h.startswith("__Host-tollgate_session="))
        assert "Secure" in cookie and "HttpOnly" in cookie and "Path=/" in cookie and "domain" not in cookie.lower()
        assert all(h.startswith("__Host-") for h in form.headers.get_list("set-cookie") + ok.headers.get_list("set-cookie"))
        as_the_proxy_forwards(ok)
        token = TOKEN.search(c.get("/dashboard/admin/accounts").text).group(1)
        name = f"proxied-{uuid.uuid4().hex[:6]}"
        evil = c.post("/dashboard/admin/accounts", data={"name": name, "csrf_token": token}, headers={"origin": "https://evil.example"})
        assert evil.status_code == 403
        made = c.post("/dashboard/admin/accounts", data={"name": name, "csrf_token": token}, headers={"origin": public})
        assert made.status_code == 303, made.text
        # the URL the anthropic SDK fetches a batch's results from, with the key: the public (TLS) one
        claude = anthropic.Anthropic(base_url=gw.base_url, api_key=(run_coro(gw.new_key()))["key"], max_retries=0, timeout=60)
        batch = claude.messages.batches.create(requests=[{"custom_id": "a", "params": {  # type: ignore[list-item]
            "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}}])
        claude.messages.batches.cancel(batch.id)
        run_coro(until(lambda: claude.messages.batches.retrieve(batch.id).processing_status == "ended", "the batch ended", timeout=60))
        assert claude.messages.batches.retrieve(batch.id).results_url == f"{public}/v1/messages/batches/{batch.id}/results"
    finally:
        stop_server(server)


def test_a_public_url_must_be_an_origin() -> None:
    import pytest

    from gateway.config import load_settings

    assert load_settings({"TOLLGATE_PUBLIC_URL": "https://api.example.com/"}).http.public_url == "https://api.example.com"
    assert load_settings({}).http.public_url is None
    for bad in ("api.example.com", "https://api.example.com/v1", "ftp://x", "https://user@api.example.com"):
        with pytest.raises(SystemExit, match="TOLLGATE_PUBLIC_URL"):
            load_settings({"TOLLGATE_PUBLIC_URL": bad})
