"""A customer's own spend alerts (billing/alerts/ watches them; the admin sets them, gateway/admin/alerts.py).

    GET  /v1/billing/alerts                       the caller's account: alert rules and the crossings seen
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from billing.alerts.spend import AlertService
from gateway.http.json_response import json_response
from gateway.http.requests import authenticate


async def my_alerts(request: Request) -> Response:
    principal = await authenticate(request, request.app.state.keys)
    alerts: AlertService = request.app.state.alerts
    return json_response({"object": "list", "rules": await alerts.rules(principal.account_id), "data": await alerts.events(principal.account_id)})


routes = [
    Route("/v1/billing/alerts", my_alerts, methods=["GET"]),
]
