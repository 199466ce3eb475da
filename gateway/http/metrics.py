"""Prometheus metrics (`GET /metrics`), one registry per app.

Per-request figures come from the ledger writer's listener (one call per metered request, the
same record the ledger gets); gauges of live state (engine queue and in-flight requests, ledger
backlog and lag, the schedulers' queues) are read at scrape time; time in the queue is recorded by
the schedulers themselves into this registry's children (`ScheduledEngine.count_into`). Labels are model ids, statuses, limit names, route names and priority
class names only: never keys, accounts or anything a client can make up.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from billing.ledger.writer import LedgerWriter, UsageRecord
from engines.base import Engine
from engines.wrappers.scheduler import ScheduledEngine
from gateway.http.errors import AuthenticationFailed

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


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
            depth = engine.queue_depth()
            if depth is not None:
                queued.add_metric([model_id], depth)
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


class _QueueState(Collector):
    """The schedulers' queues (engines/wrappers/scheduler.py), read at scrape time."""

    def __init__(self, schedulers: list[ScheduledEngine]) -> None:
        self._schedulers = schedulers

    def collect(self) -> Iterator[Any]:
        waiting = GaugeMetricFamily(
            "tollgate_queue_waiting", "Requests waiting in the gateway's queue for an engine slot.", labels=["model", "priority"]
        )
        running = GaugeMetricFamily("tollgate_queue_running", "Requests the scheduler has let into the engine.", labels=["model"])
        capacity = GaugeMetricFamily("tollgate_queue_capacity", "Requests the scheduler lets into the engine at once.", labels=["model"])
        for scheduler in self._schedulers:
            state = scheduler.snapshot()
            for priority, count in state["waiting"].items():
                waiting.add_metric([state["model"], priority], count)
            running.add_metric([state["model"]], state["running"])
            if state["capacity"] is not None:
                capacity.add_metric([state["model"]], state["capacity"])
        yield waiting
        yield running
        yield capacity


class Metrics:
    def __init__(self, engines: Mapping[str, Engine], ledger: LedgerWriter, *, multiproc_dir: str | None = None) -> None:
        self.multiproc_dir = multiproc_dir  # several workers: where prometheus_client keeps every worker's values
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
        self.queue_wait = Histogram(
            "tollgate_queue_wait_seconds", "Time in the gateway's queue before an engine took the request, by priority class.",
            ["model", "priority"], buckets=QUEUE_BUCKETS, registry=reg,
        )
        self.queue_abandoned = Counter(
            "tollgate_queue_abandoned", "Requests whose client left while they waited in the queue (no engine saw them).",
            ["model", "priority"], registry=reg,
        )
        self._children: dict[tuple[Any, ...], Any] = {}
        self._live: list[Collector] = [_LiveState(engines, ledger)]
        reg.register(self._live[0])

    def observe_usage(self, record: UsageRecord) -> None:
        """Ledger listener: called once per metered request."""
        model = record.model
        self._child(self.requests, model, record.status).inc()
        self._child(self.input_tokens, model).inc(record.prompt_tokens)
        self._child(self.output_tokens, model).inc(record.completion_tokens)
        self._child(self.latency, model).observe(record.total_ms / 1000.0)
        if record.ttft_ms is not None:
            self._child(self.ttft, model).observe(record.ttft_ms / 1000.0)

    def watch_queues(self, schedulers: list[ScheduledEngine]) -> None:
        for scheduler in schedulers:
            model, names = scheduler.model_id, [c.name for c in scheduler.classes]
            scheduler.count_into(
                [self._child(self.queue_wait, model, name) for name in names],
                [self._child(self.queue_abandoned, model, name) for name in names],
            )
        self._live.append(_QueueState(schedulers))
        self.registry.register(self._live[-1])

    def quota_rejected(self, limit_name: str) -> None:
        self.quota_rejections.labels(limit_name).inc()

    def http_response(self, route: str, code: int) -> None:
        self._child(self.http, route, code).inc()

    def _child(self, metric: Any, *labels: Any) -> Any:
        """`metric.labels(*labels)`, resolved once per label set (`labels()` costs a lock and string
        work per call). Label values are bounded: models, routes, codes, statuses, classes."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*(str(v) for v in labels))
        return child

    def render(self) -> bytes:
        shared = self.multiproc_dir
        if not shared:
            return generate_latest(self.registry)
        # Several workers (`tollgate serve --workers N`): counters and histograms summed over every
        # worker's files; the live gauges (in flight, queues, ledger backlog) are this worker's.
        registry = CollectorRegistry()
        MultiProcessCollector(registry, shared)
        for collector in self._live:
            registry.register(collector)
        return generate_latest(registry)


async def metrics_endpoint(request: Request) -> Response:
    """Prometheus text. Open by default (a scraper's network only, README); with
    TOLLGATE_METRICS_TOKEN set, only for `Authorization: Bearer <that token>`."""
    token = request.app.state.settings.dashboards.metrics_token
    if token:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            return AuthenticationFailed("GET /metrics needs the metrics token: Authorization: Bearer <token>.",
                                        headers={"WWW-Authenticate": "Bearer"}).response()
    metrics: Metrics = request.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
