"""The Starlette application: `create_app()` puts together the wiring (gateway/wiring.py), the
route table (`ROUTES`: each API's routes, from the module that owns it) and the error handlers
(gateway/http/error_handlers.py)."""

from __future__ import annotations

import functools
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import Route

from engines.base import Engine
from gateway.admin import routes as admin
from gateway.api.account import alerts as account_alerts, credits as account_credits, invoices as account_invoices
from gateway.api.account.usage import get_usage
from gateway.api.anthropic import messages as anthropic_api, models as anthropic_models
from gateway.api.anthropic.errors import anthropic_caller
from gateway.api.openai import chat as openai_chat, embeddings as embeddings_api, models as openai_models, responses as openai_responses
from gateway.api.openapi import openapi_document
from gateway.batches import anthropic_api as batch_anthropic, openai_api as batch_openai
from gateway.dashboard import views as dashboard
from gateway.dashboard.pages import UnreadableForm, unreadable_form
from gateway.http import drain, health
from gateway.config import Settings
from gateway.http.error_handlers import HANDLERS, api_error, database_unreachable, error_response, http_error, unexpected_error
from gateway.http.logs import RequestContext
from gateway.http.metrics import metrics_endpoint
from gateway.services import Services
from gateway.webhooks import stripe as stripe_webhooks
from gateway.wiring import build_engines, freeze_heap, lifespan, open_ledger, orphan_journals, schedule, share_replicas

__all__ = [
    "Gateway", "create_app", "api_error", "http_error", "unexpected_error", "database_unreachable",
    "build_engines", "freeze_heap", "open_ledger", "orphan_journals", "schedule", "share_replicas",
]

# Most of the traffic: dispatched before Starlette's router (Gateway below).
HOT = {"/v1/chat/completions": openai_chat.chat_completions, "/v1/completions": openai_chat.completions}

def _by_caller(openai_endpoint: Any, anthropic_endpoint: Any) -> Any:
    async def endpoint(request: Request) -> Any:
        return await (anthropic_endpoint if anthropic_caller(request) else openai_endpoint)(request)

    return endpoint


def _no_store(endpoint: Any) -> Any:
    @functools.wraps(endpoint)  # its name stays the route's label in logs and metrics
    async def private(request: Request) -> Any:
        response = await endpoint(request)
        response.headers.setdefault("cache-control", "no-store")
        return response

    return private


def _private(*routes: Route) -> list[Route]:
    """A customer's own usage, balance, statements, invoices and alerts (the dashboard's charts read
    them with its session): `Cache-Control: no-store`, as the dashboard's pages, so no cache keeps them."""
    return [Route(r.path, _no_store(r.endpoint), methods=sorted((r.methods or set()) - {"HEAD"}), name=r.name) for r in routes]


ROUTES = [
    *openai_chat.routes,
    # One path, both APIs: Anthropic's shape for a caller that speaks it (anthropic-version, x-api-key).
    Route("/v1/models", _by_caller(openai_models.list_models, anthropic_models.list_models), methods=["GET"]),
    Route("/v1/models/{model_id:path}", _by_caller(openai_models.get_model, anthropic_models.get_model), methods=["GET"]),
    *health.routes,
    Route("/openapi.json", openapi_document, methods=["GET"]),
    *admin.routes,  # /admin/...: every one behind the admin-key check (gateway/admin/guard.py)
    *_private(Route("/v1/usage", get_usage, methods=["GET"])),
    Route("/metrics", metrics_endpoint, methods=["GET"]),
    *dashboard.routes,
    *_private(*account_invoices.routes),
    *stripe_webhooks.routes,
    *_private(*account_credits.routes),
    *_private(*account_alerts.routes),
    *embeddings_api.routes,
    *anthropic_api.routes,
    *openai_responses.routes,
    *batch_openai.routes,  # /v1/files, /v1/batches
    *batch_anthropic.routes,  # /v1/messages/batches
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
        exception_handlers={**HANDLERS, UnreadableForm: unreadable_form},
    )
