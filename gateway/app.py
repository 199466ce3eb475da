"""The Starlette application: `create_app()` puts together the wiring (gateway/wiring.py), the
routes (gateway/routes.py) and the error handlers (gateway/http/error_handlers.py)."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request

from engines.base import Engine
from gateway.http import drain
from gateway.config import Settings
from gateway.http.error_handlers import HANDLERS, api_error, database_unreachable, error_response, http_error, unexpected_error
from gateway.http.logs import RequestContext
from gateway.routes import HOT, ROUTES
from gateway.services import Services
from gateway.wiring import build_engines, freeze_heap, lifespan, open_ledger, orphan_journals, schedule, share_replicas

__all__ = [
    "Gateway", "create_app", "api_error", "http_error", "unexpected_error", "database_unreachable",
    "build_engines", "freeze_heap", "open_ledger", "orphan_journals", "schedule", "share_replicas",
]


def _endpoint_app(endpoint: Any) -> Any:
    """A request-response endpoint as a bare ASGI app (no router, no exception middleware)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scope["endpoint"] = endpoint  # the route label in logs and metrics, as the router sets it
        response = await endpoint(Request(scope, receive, send))
        await response(scope, receive, send)

    return app


class Gateway(Starlette):
    """Starlette, with the generation routes dispatched before the router.

    `POST /v1/chat/completions` and `POST /v1/completions` are most of the traffic. They skip
    Starlette's middleware stack, router scan and exception layers (eight ASGI frames that every
    streamed chunk resumes through) and run under the same RequestContext (ids, logs, metrics,
    security headers) with the same error answers. Anything else, other methods on those paths
    included, goes through Starlette as before."""

    def __init__(self, *, hot: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state: Services = Services()  # type: ignore[assignment]  # typed: what the routes use
        self._hot = {path: RequestContext(_endpoint_app(endpoint), on_error=error_response) for path, endpoint in hot.items()}
        self.draining = False  # set on SIGTERM (gateway/http/drain.py): new requests get 503 with Retry-After
        self._refuse = RequestContext(drain.refuse)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.draining and drain.is_refused(scope):
            scope["app"] = self
            await self._refuse(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            app = self._hot.get(scope["path"])
            if app is not None:
                scope["app"] = self
                await app(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(
    settings: Settings, engines: dict[str, Engine] | None = None, *, freeze_gc: bool = False, exit_on_load_failure: bool = False
) -> Gateway:
    """Builds the app. Engines passed in are owned by the caller (not started or stopped here).
    `freeze_gc` (the server's processes): `freeze_heap()` once started and again as each model
    that loads in the background is in."""
    return Gateway(
        hot=HOT,
        routes=ROUTES,
        lifespan=lifespan(settings, engines, freeze_gc=freeze_gc, exit_on_load_failure=exit_on_load_failure),
        middleware=[Middleware(RequestContext)],  # ids, logs, metrics, security headers, query guard: one layer
        exception_handlers=HANDLERS,
    )
