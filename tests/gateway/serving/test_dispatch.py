"""The generation routes are dispatched before Starlette's router (gateway/app.py `Gateway`): the
same answers as through the router, errors included, with request ids and security headers."""

from __future__ import annotations

from typing import Any

import httpx
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.app import Gateway, api_error, http_error, unexpected_error
from gateway.http.errors import APIError, InvalidRequest
from gateway.http.logs import RequestContext


async def _ok(request: Request) -> Response:
    return Response(b'{"ok": true}', media_type="application/json")


async def _bad(request: Request) -> Response:
    raise InvalidRequest("temperature must be at most 2", param="temperature")


async def _broken(request: Request) -> Response:
    raise RuntimeError("a bug with sk-secret-looking text")


def _app() -> Gateway:
    hot = {"/v1/chat/completions": _bad, "/v1/completions": _broken, "/v1/ok": _ok}
    return Gateway(
        hot=hot,
        routes=[Route(path, endpoint, methods=["POST"]) for path, endpoint in hot.items()],
        middleware=[Middleware(RequestContext)],
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: unexpected_error},
    )


def _shape(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert len(r.headers["x-request-id"]) == 32 and r.headers["x-content-type-options"] == "nosniff"
    return err


async def test_hot_routes_answer_as_the_router_would() -> None:
    app = _app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://t") as c:
        ok = await c.post("/v1/ok", json={})
        assert ok.status_code == 200 and ok.json() == {"ok": True} and len(ok.headers["x-request-id"]) == 32

        bad = await c.post("/v1/chat/completions", json={})
        assert bad.status_code == 400
        assert _shape(bad)["param"] == "temperature"

        broken = await c.post("/v1/completions", json={})
        assert broken.status_code == 500
        err = _shape(broken)
        assert err["type"] == "server_error" and "sk-secret" not in broken.text

        assert app.middleware_stack is None  # Starlette's stack (built on first use) was never entered

        # Other methods on a hot path still go through the router: an OpenAI-shaped 405.
        wrong = await c.get("/v1/chat/completions")
        assert wrong.status_code == 405 and _shape(wrong)["type"] == "invalid_request_error"
        missing = await c.post("/v1/nothing-here", json={})
        assert missing.status_code == 404 and _shape(missing)
