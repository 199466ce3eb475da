"""/metrics in Prometheus format and structured JSON logs with request ids, through real requests."""

from __future__ import annotations

import io
import json
import logging
import re
from datetime import datetime, timezone
from itertools import islice
from typing import Any

import httpx
from openai import RateLimitError
from prometheus_client.parser import text_string_to_metric_families

from engines.wrappers.scheduler import ScheduledEngine
from gateway.http.logs import (
    JsonFormatter,
    access_log,
    client_request_id,
    client_request_id_var,
    configure_logging,
    iso_ms,
    request_id_var,
    write_access_line,
)
from gateway.http.metrics import _LiveState
from tests.conftest import MODEL, Gateway
from tests.fakes.engine import FakeEngine


def scrape(gw: Gateway) -> tuple[str, dict[str, dict[tuple[tuple[str, str], ...], float]]]:
    r = httpx.get(gw.base_url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return r.text, samples


def value(samples: dict[str, Any], name: str, **labels: str) -> float:
    return samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


async def test_metrics_count_requests_tokens_latency_and_rejections(gateway: Gateway, client_for: Any) -> None:
    key = await gateway.new_key()
    _, before = scrape(gateway)
    raw = await client_for(key["key"]).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say yes."}], max_tokens=5, temperature=0)
    usage = raw.parse().usage
    await gateway.ledger_row(raw.headers["x-request-id"])

    # A key with rpm 0 is refused by the quota: counted by limit name.
    async with gateway.admin_client() as admin:
        limited = (await admin.post("/admin/keys", json={"account_id": key["account_id"]})).json()
        patched = await admin.patch(f"/admin/keys/{limited['id']}", json={"limits": {"rpm": 0}})
        assert patched.status_code == 200, patched.text
    try:
        await client_for(limited["key"]).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "no"}], max_tokens=2)
        raise AssertionError("rpm 0 should refuse")
    except RateLimitError:
        pass

    text, after = scrape(gateway)
    delta = lambda name, **l: value(after, name, **l) - value(before, name, **l)  # noqa: E731
    assert delta("tollgate_requests_total", model=MODEL, status="completed") >= 1
    assert delta("tollgate_input_tokens_total", model=MODEL) >= usage.prompt_tokens
    assert delta("tollgate_output_tokens_total", model=MODEL) >= usage.completion_tokens
    assert delta("tollgate_request_duration_seconds_count", model=MODEL) >= 1
    assert delta("tollgate_time_to_first_token_seconds_count", model=MODEL) >= 1
    assert delta("tollgate_quota_rejections_total", limit="rpm") == 1
    assert delta("tollgate_http_responses_total", route="chat_completions", code="429") == 1
    assert value(after, "tollgate_engine_requests_in_flight", model=MODEL) >= 0
    for family in ("tollgate_engine_queue_depth", "tollgate_ledger_backlog_rows", "tollgate_ledger_write_lag_seconds",
                   "tollgate_ledger_write_errors_total"):
        assert f"# TYPE {family.removesuffix('_total')}" in text
    assert key["key"] not in text and limited["key"] not in text and gateway.admin_key not in text
    labels = {name for series in after.values() for key_ in series for name, _ in key_}
    assert labels <= {"model", "status", "route", "code", "limit", "le", "priority"}  # never keys or accounts (priority: a class name from the settings)


CLIENT_LOGGERS = {"httpx", "httpx2", "httpcore", "openai"}


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


async def test_json_logs_carry_request_ids_and_never_keys(gateway: Gateway, client_for: Any) -> None:
    key = await gateway.new_key()
    capture = Capture()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(capture)
    root.setLevel(logging.INFO)
    try:
        client = client_for(key["key"])
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            extra_headers={"x-request-id": "client-abc.123"})
        server_id = raw.headers["x-request-id"]
        assert raw.headers["x-client-request-id"] == "client-abc.123"
        assert (await gateway.ledger_row(server_id))["request_id"] == server_id  # the ledger id stays ours

        bad = httpx.get(gateway.v1 + "/models", headers={"Authorization": f"Bearer {key['key']}x", "x-request-id": "no spaces allowed"})
        assert bad.status_code == 401 and "x-client-request-id" not in bad.headers
        assert len(bad.headers["x-request-id"]) == 32
        pasted = httpx.get(gateway.base_url + f"/v1/models/{key['key']}", headers={"Authorization": f"Bearer {key['key']}"})
        assert pasted.status_code == 404
    finally:
        root.removeHandler(capture)
        root.setLevel(old_level)

    # The test's own HTTP clients log into the same process: keep the server's lines only.
    server_lines = [line for line in capture.lines if json.loads(line)["logger"].split(".")[0] not in CLIENT_LOGGERS]
    entries = [json.loads(line) for line in server_lines]  # every line is one JSON object
    access = [e for e in entries if e["logger"] == "tollgate.access"]
    mine = next(e for e in access if e.get("request_id") == server_id)
    assert mine["client_request_id"] == "client-abc.123" and mine["route"] == "chat_completions"
    assert mine["status"] == 200 and mine["duration_ms"] > 0 and mine["path"] == "/v1/chat/completions"
    refused = next(e for e in access if e.get("request_id") == bad.headers["x-request-id"])
    assert refused["status"] == 401 and "client_request_id" not in refused
    assert all({"ts", "level", "logger", "msg"} <= set(e) for e in entries)
    assert any(e["path"] == "/v1/models/sk-***" for e in access)  # a key pasted into a URL is masked
    assert not any(key["key"][3:] in line for line in server_lines)


def test_a_metrics_token_guards_the_scrape(gateway: Gateway) -> None:
    token = "scrape-secret-42"
    app = gateway.app
    open_settings = app.state.settings
    app.state.settings = open_settings.with_overrides(dashboards={"metrics_token": token})
    try:
        url = gateway.base_url + "/metrics"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {token}"}):
            r = httpx.get(url, headers=headers, timeout=30)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and token not in r.text
        r = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 200 and "tollgate_http_responses_total" in r.text
    finally:
        app.state.settings = open_settings
    assert httpx.get(gateway.base_url + "/metrics", timeout=30).status_code == 200  # unset: open, as before


def test_the_direct_access_line_is_the_line_logging_would_write() -> None:
    """Every request's access line skips building a LogRecord while logging is as configure_logging
    left it; the line is the one the JSON handler writes for the same record, key for key."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging("json", "info")
        direct = io.StringIO()
        root.handlers[0].setStream(direct)
        fields = {"method": "POST", "path": "/v1/chat/completions", "route": "chat_completions", "status": 200, "duration_ms": 1.25}
        assert write_access_line("POST /v1/chat/completions 200", "a" * 32, "client-1", fields)
        assert write_access_line("POST /v1/chat/completions 200", "b" * 32, None, fields)

        via_logging = io.StringIO()
        other = logging.StreamHandler(via_logging)
        other.setFormatter(JsonFormatter())
        root.addHandler(other)  # logging is no longer as configured: the direct line declines
        assert not write_access_line("POST /v1/chat/completions 200", "c" * 32, None, fields)
        for rid, crid in (("a" * 32, "client-1"), ("b" * 32, None)):
            tokens = request_id_var.set(rid), client_request_id_var.set(crid)
            access_log.info("%s %s %d", "POST", "/v1/chat/completions", 200, extra={"fields": fields})
            request_id_var.reset(tokens[0])
            client_request_id_var.reset(tokens[1])
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    # The configured handler got the two direct lines, then the two records through logging.
    lines = [json.loads(line) for line in direct.getvalue().splitlines()]
    assert len(lines) == 4 and [json.loads(line) for line in via_logging.getvalue().splitlines()] == lines[2:]
    for a, b in zip(lines[:2], lines[2:]):
        assert list(a) == list(b) and {k: v for k, v in a.items() if k != "ts"} == {k: v for k, v in b.items() if k != "ts"}
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", a["ts"])
    for t in (0.0, 1_795_000_000.0, 1_795_000_000.9995, 1_795_000_000.9999996, 1_795_000_059.001, 1_795_000_060.5, 1_795_000_061.0005):
        assert iso_ms(t) == datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


def test_client_request_ids_come_from_the_raw_headers() -> None:
    assert client_request_id([(b"host", b"x"), (b"x-request-id", b"abc-1")]) == "abc-1"
    assert client_request_id([(b"x-client-request-id", b"c2"), (b"x-request-id", b"r1")]) == "r1"  # x-request-id first
    assert client_request_id([(b"x-request-id", b""), (b"x-client-request-id", b"c2")]) == "c2"
    assert client_request_id([(b"x-request-id", b"has space")]) is None
    assert client_request_id([(b"x-request-id", b"x" * 129)]) is None
    assert client_request_id([(b"host", b"x")]) is None


def test_a_failed_access_line_is_reported_once_not_written_twice() -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)

    class Broken(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError("disk full")

    try:
        configure_logging("json", "info")
        handler = root.handlers[0]
        handler.setStream(Broken())
        reported: list[logging.LogRecord] = []
        handler.handleError = reported.append  # type: ignore[method-assign]
        assert write_access_line("POST /v1/chat/completions 200", "d" * 32, None, {"status": 200})
        assert [r.getMessage() for r in reported] == ["POST /v1/chat/completions 200"]
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_the_queue_depth_gauge_has_a_series_for_each_engine_with_a_queue() -> None:
    # Engine.queue_depth(): None for an engine without a queue of its own, the scheduler's count otherwise.
    engines = {"queued": ScheduledEngine(FakeEngine("queued")), "bare": FakeEngine("bare")}
    _, queued = islice(_LiveState(engines, ledger=None).collect(), 2)  # type: ignore[arg-type]
    assert [(s.labels["model"], s.value) for s in queued.samples] == [("queued", 0)]
