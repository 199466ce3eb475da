"""Spend alerts for the admin (billing/alerts/spend.py watches them).

    GET  /admin/accounts/{id}/alerts              an account's alert rules and the crossings seen
    POST /admin/accounts/{id}/alerts              {"metric": monthly_spend|monthly_tokens|balance_below, "threshold":
                                                   "5.00" (USD) or tokens, or "percent": 80; "key_id"; "url"} -> the secret, once
"""

from __future__ import annotations

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from billing.alerts.spend import AlertService
from billing.credits.balance import CreditError, parse_usd
from gateway.admin.accounts import StrictStr
from gateway.admin.credits import account_id_param
from gateway.api.openai.protocol import StrictInt, _StrictModel, parse
from gateway.http.errors import InvalidRequest, NotFound
from gateway.http.json_response import json_response
from gateway.http.requests import read_json


class AddAlert(_StrictModel):
    metric: str = Field(min_length=1, max_length=16)
    threshold: StrictStr | StrictInt | None = None  # USD for spend and balance, tokens for monthly_tokens
    percent: StrictInt | None = Field(default=None, ge=1, le=1000)
    key_id: StrictInt | None = Field(default=None, ge=1, le=2**31 - 1)
    url: str = Field(min_length=1, max_length=2000)

    def check_supported(self, passthrough: bool = False) -> None:
        return None


async def admin_alerts(request: Request) -> Response:
    account_id = account_id_param(request)
    alerts: AlertService = request.app.state.alerts
    return json_response({"object": "list", "rules": await alerts.rules(account_id), "data": await alerts.events(account_id)})


async def admin_add_alert(request: Request) -> Response:
    state = request.app.state
    account_id = account_id_param(request)
    body = parse(AddAlert, await read_json(request, state.settings.http.max_body_bytes))
    if await state.keys.get_account(account_id=account_id) is None:
        raise NotFound(f"No account with id {account_id}.", param="account_id")
    try:
        threshold = body.threshold
        if threshold is not None and body.metric != "monthly_tokens":
            threshold = parse_usd(threshold, "threshold")
        elif threshold is not None and not isinstance(threshold, int):
            raise CreditError("threshold of monthly_tokens is an integer number of tokens", "threshold")
        rule = await state.alerts.add_rule(account_id, body.metric, url=body.url, threshold=threshold, percent=body.percent,
                                           key_id=body.key_id)
    except CreditError as exc:
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from None
    return json_response(rule, 201)


ENDPOINTS = [
    ("/admin/accounts/{account_id}/alerts", admin_alerts, ["GET"]),
    ("/admin/accounts/{account_id}/alerts", admin_add_alert, ["POST"]),
]
