"""Prometheus metrics (`GET /metrics`), one registry per app.

Per-request figures come from the ledger writer's listener (one call per metered request, the
same record the ledger gets); gauges of live state (engine queue and in-flight requests, ledger
backlog and lag) are read at scrape time. Labels are model ids, statuses, limit names and route
names only: never keys, accounts or anything a client can make up.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from billing.ledger import LedgerWriter, UsageRecord
from engines.base import Engine

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _LiveState(Collector):
    """Gauges read when Prometheus scrapes: nothing to keep in step."""

    def __init__(self, engines: Mapping[str, Engine], ledger: LedgerWriter) -> None:
        self._engines = engines
        self._ledger = ledger

    def collect(self) -> Iterator[Any]:
        in_flight = GaugeMetricFamily(
            "tollgate_engine_requests_in_flight", "Requests the engine holds (running or queued inside it).", labels=["model"]
        )
        queued = GaugeMetricFamily(
            "tollgate_engine_queue_depth", "Requests waiting inside the engine for a batch slot.", labels=["model"]
        )
        for model_id, engine in self._engines.items():
            in_flight.add_metric([model_id], engine.requests_in_flight())
            depth = getattr(engine, "queue_depth", None)
            if callable(depth):
                queued.add_metric([model_id], depth())
        yield in_flight
        yield queued
        yield GaugeMetricFamily("tollgate_ledger_backlog_rows", "Ledger rows recorded but not yet written.", value=self._ledger.backlog)
        yield GaugeMetricFamily(
            "tollgate_ledger_write_lag_seconds", "Age of the oldest ledger row not yet written (0 when none).",
            value=self._ledger.lag_seconds,
        )
        yield CounterMetricFamily(
            "tollgate_ledger_write_errors", "Failed ledger batch writes (rows are kept and retried).",
            value=self._ledger.write_errors,
        )


class Metrics:
    def __init__(self, engines: Mapping[str, Engine], ledger: LedgerWriter) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("tollgate_requests", "Metered requests by model and ledger status.", ["model", "status"], registry=reg)
        self.input_tokens = Counter("tollgate_input_tokens", "Prompt tokens by model.", ["model"], registry=reg)
        self.output_tokens = Counter("tollgate_output_tokens", "Completion tokens by model.", ["model"], registry=reg)
        self.latency = Histogram(
            "tollgate_request_duration_seconds", "Time from admission to the last token.", ["model"],
            buckets=LATENCY_BUCKETS, registry=reg,
        )
        self.ttft = Histogram(
            "tollgate_time_to_first_token_seconds", "Time from admission to the first token.", ["model"],
            buckets=TTFT_BUCKETS, registry=reg,
        )
        self.http = Counter(
            "tollgate_http_responses", "HTTP responses by route name and status code.", ["route", "code"], registry=reg
        )
        self.quota_rejections = Counter(
            "tollgate_quota_rejections", "Requests refused by a quota or rate limit, by limit.", ["limit"], registry=reg
        )
        reg.register(_LiveState(engines, ledger))

    def observe_usage(self, record: UsageRecord) -> None:
        """Ledger listener: called once per metered request."""
        model = record.model
        self.requests.labels(model, record.status).inc()
        self.input_tokens.labels(model).inc(record.prompt_tokens)
        self.output_tokens.labels(model).inc(record.completion_tokens)
        self.latency.labels(model).observe(record.total_ms / 1000.0)
        if record.ttft_ms is not None:
            self.ttft.labels(model).observe(record.ttft_ms / 1000.0)

    def quota_rejected(self, limit_name: str) -> None:
        self.quota_rejections.labels(limit_name).inc()

    def http_response(self, route: str, code: int) -> None:
        self.http.labels(route, str(code)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def metrics_endpoint(request: Request) -> Response:
    metrics: Metrics = request.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
