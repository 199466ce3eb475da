"""`GET /openapi.json` describes the real API: every route of the app is in it, and schemathesis
(positive and negative examples, a bounded number per operation) finds no 5xx and no response
that breaks the document. The engine is a fast test double: this is about HTTP, not generation."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Route

from gateway.api.openapi import document, route_path
from gateway.http.requests import id_value
from tests.conftest import MODEL, Gateway, run_coro, start_gateway
from tests.fakes.engine import FakeEngine

EXAMPLES = int(os.environ.get("TOLLGATE_TEST_SCHEMATHESIS_EXAMPLES", "25"))
UNDOCUMENTED = re.compile(r"^/(dashboard|static)(/|$)")  # HTML pages behind sessions and CSRF tokens
CHECKS = [
    not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
    response_headers_conformance, negative_data_rejection,
]

schema = schemathesis.openapi.from_dict(document())  # operations the app does not mount answer 404, which is documented
# Unknown query parameters and headers are ignored, as HTTP APIs do; OpenAPI does not forbid them.
schema.config.generation.update(allow_extra_parameters=False)


@pytest.fixture(scope="module")
def api(fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, dict[int, int]]]:
    server, gw = start_gateway(fresh_pg_database(migrated=True), FakeEngine(MODEL), tmp_path_factory.mktemp("gw-openapi"))
    spare = run_coro(gw.new_key())  # what DELETE /admin/keys/{id} revokes instead of the admin key
    keys = httpx.get(gw.base_url + "/admin/keys", headers={"Authorization": f"Bearer {gw.admin_key}"}).json()["data"]
    [admin_key_id] = [k["id"] for k in keys if gw.admin_key.startswith(k["prefix"])]
    try:
        yield gw, {admin_key_id: spare["id"]}
    finally:
        server.__exit__()


def test_every_route_is_documented(api: tuple[Gateway, dict[int, int]]) -> None:
    gw, _ = api
    served = httpx.get(gw.base_url + "/openapi.json").json()
    routes = {route_path(r.path) for r in gw.app.routes if isinstance(r, Route)}
    assert served == document(frozenset(routes))
    documented = {(path, method) for path, ops in served["paths"].items() for method in ops}
    for route in gw.app.routes:
        if not isinstance(route, Route) or UNDOCUMENTED.match(route.path):
            continue
        for method in route.methods or ():
            if method != "HEAD":
                assert (route_path(route.path), method.lower()) in documented, (
                    f"{method} {route.path} is served but not described in gateway/api/openapi.py"
                )


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_5xx_and_no_schema_violations(case: Any, api: tuple[Gateway, dict[int, int]]) -> None:
    gw, instead = api
    if case.method == "DELETE" and case.path_parameters and "key_id" in case.path_parameters:
        # never revoke the key the test runs with, however the example spells its id (schemathesis 4.3x
        # also sends path parameters as strings: '1')
        named = id_value(str(case.path_parameters["key_id"]))
        if named in instead:
            case.path_parameters["key_id"] = instead[named]
    headers = {"Authorization": f"Bearer {gw.admin_key}"}
    if case.path == "/webhooks/stripe":
        headers = {}
    case.call_and_validate(base_url=gw.base_url, headers=headers, checks=CHECKS)


def test_each_lists_documented_limit_is_the_one_it_keeps(api: tuple[Gateway, dict[int, int]]) -> None:
    """The document's `limit` bounds are the routes' own: the documented maximum and an empty value
    are answered, one more than the maximum and 0 are 400s naming `limit` (the files list once
    documented 100 and served up to 10,000)."""
    gw, _ = api
    headers = {"Authorization": f"Bearer {gw.admin_key}"}
    lists = {
        path: next(p["schema"]["anyOf"][0] for p in ops["get"]["parameters"] if p["name"] == "limit")
        for path, ops in document()["paths"].items()
        if path.startswith(("/v1/files", "/v1/batches", "/v1/messages/batches")) and "get" in ops
        and any(p["name"] == "limit" for p in ops["get"].get("parameters", []))
    }
    assert set(lists) == {"/v1/files", "/v1/batches", "/v1/messages/batches"}
    for path, bounds in lists.items():
        for limit, status in ((bounds["maximum"], 200), ("", 200), (bounds["maximum"] + 1, 400), (bounds["minimum"] - 1, 400)):
            answer = httpx.get(gw.base_url + path, params={"limit": limit}, headers=headers)
            assert answer.status_code == status, (path, limit, answer.text)
            if status == 400:
                assert "limit" in answer.text, (path, limit, answer.text)
