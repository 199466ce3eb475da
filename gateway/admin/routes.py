"""The /admin route group: every admin endpoint, each behind the one admin-key check
(gateway/admin/guard.py). The modules list their endpoints as (path, handler, methods); only
here do they become routes, so none can be served without the check."""

from __future__ import annotations

from gateway.admin import accounts, alerts, credits, invoices
from gateway.admin.guard import admin_route

routes = [
    admin_route(path, endpoint, methods)
    for path, endpoint, methods in (*accounts.ENDPOINTS, *invoices.ENDPOINTS, *credits.ENDPOINTS, *alerts.ENDPOINTS)
]
