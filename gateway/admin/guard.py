"""The admin routes' one authentication step: every route of the group (gateway/admin/routes.py)
is built by `admin_route`, which puts `AdminKey` in front of its handler.

AdminKey runs after the router matched the path and the method, so an unknown /admin path is
still a 404 and a wrong method a 405, as for any route; only a matched admin route asks for the
key: 401 without a valid one, 403 for a customer's key (gateway/http/requests.py says which).
The handlers read the admin's principal with `admin_principal(request)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from billing.keys.store import Principal
from gateway.http.requests import authenticate_admin

ADMIN = "admin"  # the key in the request's state (scope["state"]) that holds the admin's principal


class AdminKey:
    """Plain ASGI: authenticates the admin key, then hands the request to the route's handler."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        principal = await authenticate_admin(request, request.app.state.keys)
        scope.setdefault("state", {})[ADMIN] = principal
        await self.app(scope, receive, send)


def admin_route(path: str, endpoint: Any, methods: Sequence[str]) -> Route:
    """A route whose handler only runs for an admin key."""
    return Route(path, endpoint, methods=list(methods), middleware=[Middleware(AdminKey)])


def admin_principal(request: Request) -> Principal:
    """The admin key's principal that AdminKey authenticated for this request."""
    principal: Principal = request.scope["state"][ADMIN]
    return principal
