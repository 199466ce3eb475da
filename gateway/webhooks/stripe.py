"""`POST /webhooks/stripe`: Stripe's events, the signature checked on the raw body
(billing/stripe/webhooks.py verifies, deduplicates and applies them; prepaid credit adds its
handlers in gateway/billing.py).
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from stripe import StripeError

from billing.stripe.webhooks import WebhookRejected
from gateway.api.account.documents import billing_of
from gateway.billing import StripeFailed
from gateway.http.errors import InvalidRequest, NotFound
from gateway.http.requests import read_body
from gateway.http.json_response import json_response

log = logging.getLogger("tollgate.billing")


async def stripe_webhook(request: Request) -> Response:
    billing = billing_of(request)
    if billing.webhooks is None:
        raise NotFound("Stripe webhooks are not configured on this server.")
    payload = await read_body(request, request.app.state.settings.http.max_body_bytes)  # the signature covers these bytes
    try:
        result = await billing.webhooks.handle(payload, request.headers.get("stripe-signature"))
    except WebhookRejected as exc:
        raise InvalidRequest(str(exc), code=exc.code) from None
    except StripeError as exc:  # could not re-read the object: Stripe delivers again later
        log.error("webhook: Stripe re-read failed: %s", exc)
        raise StripeFailed("Could not read the object from Stripe; retry later.") from None
    return json_response(result)


routes = [
    Route("/webhooks/stripe", stripe_webhook, methods=["POST"]),
]
