"""GET /healthz (the process answers) and GET /readyz (every model loaded, not draining; whether the
quota store answers, in its body): what a load balancer or an orchestrator probes."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engines.base import Engine
from gateway.http.errors import EngineNotReady, ServiceUnavailable
from gateway.http.json_response import json_response


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    if request.app.draining:  # SIGTERM: out of the load balancer at once (gateway/http/drain.py)
        return ServiceUnavailable("This server is shutting down.", code="draining", headers={"Retry-After": "1"}).response()
    engines: dict[str, Engine] = request.app.state.service.engines
    failed = request.app.state.load_failures
    if failed:
        reasons = "; ".join(f"{mid}: {why}" for mid, why in failed.items())
        return ServiceUnavailable(f"models failed to load: {reasons}", code="model_load_failed").response()
    pending = [mid for mid, e in engines.items() if not e.ready]
    if pending:
        return EngineNotReady(f"models still loading: {', '.join(pending)}", headers={"Retry-After": "5"}).response()
    # Redis out is not a reason to leave the load balancer: every process shares it, and each answers
    # for itself (fail-closed: 503 `quota_unavailable`; fail-open: served, counted from the ledger).
    # What an operator's monitoring reads instead: `quota_store`.
    reachable = await request.app.state.limiter.reachable()
    store = "in-process" if reachable is None else "reachable" if reachable else "unreachable"
    return json_response({"status": "ready", "models": list(engines), "quota_store": store})


routes = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
]
