"""What the logs, metrics and start-up checks must get right, each pinned by a test that fails
without its fix:

- a client that leaves a non-streamed completion is logged and counted as 499, never 500;
- a key sent as `x-request-id` is masked in the log, the echoed header and everywhere else;
- a `TOLLGATE_ADMIN_KEY` that authentication would never accept is refused at start, by the one
  rule both use (billing/keys/format.py);
- rendering an invoice PDF writes no fontTools INFO lines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import orjson
import pytest

from billing import migrate
from billing.db import create_engine
from billing.config import BillingConfig
from billing.keys.format import MASK, MAX_LENGTH, MIN_LENGTH, key_problem, looks_like_key, mask_keys
from gateway.batches.results import BadInput, parse_input
from billing.keys.store import KeyStore, generate_key
from engines.base import FINISH_CANCELLED, EngineOutput, EngineRequest
from gateway.http.errors import APIError
from gateway.http.hardening import WATCH_KEY, ConnectionWatch
from gateway.http.logs import JsonFormatter, RequestContext, client_request_id
from tests.conftest import MODEL, Gateway, start_gateway
from tests.fakes.engine import FakeEngine

ROOT = Path(__file__).resolve().parents[3]
WAIT = 30.0  # seconds any one barrier below may take before the test fails


class HoldingEngine(FakeEngine):
    """Produces nothing until its request is cancelled: the client leaving is the only way out.
    `admitted` is set (from the server's thread) once a request reached the engine."""

    def __init__(self, model_id: str) -> None:
        super().__init__(model_id)
        self.admitted = threading.Event()
        self._wake: dict[str, asyncio.Event] = {}

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        wake = self._wake[request.request_id] = asyncio.Event()
        self._running.add(request.request_id)
        try:
            self.admitted.set()
            await wake.wait()
            yield EngineOutput("", [], FINISH_CANCELLED, len(request.prompt_token_ids or []), 0)
        finally:
            self._running.discard(request.request_id)
            self._wake.pop(request.request_id, None)

    def cancel(self, request_id: str) -> None:
        wake = self._wake.get(request_id)
        if wake is not None:
            wake.set()


class Lines(logging.Handler):
    """Every log line the server writes (as the JSON formatter writes it); `access_for(path)` waits
    for the access-log line of a request to that path."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []
        self._changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] in ("httpx", "httpcore"):  # the test's own client
            return
        line = self.format(record)
        with self._changed:
            self.lines.append(line)
            self._changed.notify_all()

    def access_for(self, path: str) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            for line in self.lines:
                entry = orjson.loads(line)
                if entry["logger"] == "tollgate.access" and entry.get("path") == path:
                    return entry
            return None

        with self._changed:
            assert self._changed.wait_for(lambda: found() is not None, timeout=WAIT), f"no access-log line for {path}"
            entry = found()
        assert entry is not None
        return entry


@pytest.fixture(scope="module")
def holding_gw(fresh_pg_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    server, gw = start_gateway(fresh_pg_database(migrated=True), HoldingEngine(MODEL), tmp_path_factory.mktemp("gw-probe"))
    try:
        yield gw
    finally:
        server.__exit__()


@pytest.fixture
def server_lines() -> Iterator[Lines]:
    """The root logger at INFO with a capturing handler, as `tollgate serve` logs (the access log is
    written through `logging` while a handler other than configure_logging's is installed)."""
    handler = Lines()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def http_responses(metrics_text: str, route: str) -> dict[str, float]:
    """`tollgate_http_responses_total` by code for one route."""
    found: dict[str, float] = {}
    for m in re.finditer(r'^tollgate_http_responses_total\{([^}]*)\} (\S+)$', metrics_text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("route") == route:
            found[labels["code"]] = float(m.group(2))
    return found


# ------------------------------------------------------------------ 499 for a client that left

def test_client_leaving_a_non_streamed_completion_is_499_in_the_access_log_and_metrics(
    holding_gw: Gateway, server_lines: Lines
) -> None:
    engine: HoldingEngine = holding_gw.engine  # type: ignore[assignment]
    key = asyncio.run(holding_gw.new_key())["key"]
    engine.admitted.clear()
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    port = int(holding_gw.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
        )
        assert engine.admitted.wait(WAIT), "the request never reached the engine"
    # The socket is closed: the client left while its one-body answer was being generated.
    entry = server_lines.access_for("/v1/chat/completions")
    assert entry["status"] == 499, entry
    assert entry["route"] == "chat_completions"
    row = asyncio.run(holding_gw.ledger_row(entry["request_id"]))
    assert row["status"] == "cancelled"
    counted = http_responses(httpx.get(holding_gw.base_url + "/metrics", timeout=WAIT).text, "chat_completions")
    assert counted.get("499") == 1.0 and "500" not in counted, counted


async def _run_context(scope_extra: dict[str, Any], app: Any) -> tuple[int, list[dict[str, Any]]]:
    """One request through RequestContext around `app`; returns the status it counted and the
    messages the server was sent."""
    counted: list[int] = []
    metrics = SimpleNamespace(http_response=lambda route, code: counted.append(code))
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b"",
             "app": SimpleNamespace(state=SimpleNamespace(metrics=metrics)), **scope_extra}
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}, {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await RequestContext(app)(scope, receive, send)
    [code] = counted
    return code, sent


async def test_client_gone_before_any_response_is_499_with_and_without_the_connection_watch() -> None:
    async def abandoned(scope: Any, receive: Any, send: Any) -> None:  # reads until the client leaves, answers nothing
        while (await receive())["type"] != "http.disconnect":
            pass

    code, sent = await _run_context({}, abandoned)  # another server: the disconnect message says so
    assert code == 499 and sent == []

    watch = ConnectionWatch()

    async def cancelled_by_watch(scope: Any, receive: Any, send: Any) -> None:
        watch.fire()  # the guarded protocol saw the connection close while the engine ran

    code, _ = await _run_context({WATCH_KEY: watch}, cancelled_by_watch)
    assert code == 499

    async def answered_late(scope: Any, receive: Any, send: Any) -> None:  # an answer after the client left
        watch.fire()
        await APIError("boom").response()(scope, receive, send)

    watch = ConnectionWatch()
    code, _ = await _run_context({WATCH_KEY: watch}, answered_late)
    assert code == 499

    async def nothing(scope: Any, receive: Any, send: Any) -> None:  # a client still there gets uvicorn's 500
        return None

    code, _ = await _run_context({WATCH_KEY: ConnectionWatch()}, nothing)
    assert code == 500


# ------------------------------------------------------------------ a key sent as x-request-id

def test_a_key_sent_as_x_request_id_is_masked_in_the_log_the_header_and_metrics(holding_gw: Gateway, server_lines: Lines) -> None:
    customer = asyncio.run(holding_gw.new_key())
    key = customer["key"]
    probes = [
        ("/v1/models", {"authorization": f"Bearer {key}", "x-request-id": key}, 200),
        ("/v1/models?probe=unauthenticated", {"x-request-id": key}, 401),
        ("/v1/models?probe=prefixed", {"authorization": f"Bearer {key}", "x-client-request-id": f"req-{key}"}, 200),
    ]
    for path, headers, status in probes:
        r = httpx.get(holding_gw.base_url + path, headers=headers, timeout=WAIT)
        assert r.status_code == status, r.text
        echoed = r.headers["x-client-request-id"]
        assert key not in echoed and key[3:12] not in echoed, echoed
        assert echoed in (MASK, f"req-{MASK}")
        assert key not in str(r.headers) and key not in r.text
    access = server_lines.access_for("/v1/models")
    assert access["client_request_id"] == MASK
    metrics = httpx.get(holding_gw.base_url + "/metrics", timeout=WAIT).text
    assert key not in metrics
    every_line = "\n".join(server_lines.lines)
    assert key not in every_line and key[3:12] not in every_line


def test_client_request_ids_are_masked_where_they_look_like_keys() -> None:
    key = generate_key()
    assert client_request_id([(b"x-request-id", key.encode())]) == MASK
    assert client_request_id([(b"x-client-request-id", f"trace-{key}".encode())]) == f"trace-{MASK}"
    assert client_request_id([(b"x-request-id", b"task-20240101")]) == "task-20240101"  # not a key: left alone
    assert client_request_id([(b"x-request-id", b"client-abc.123")]) == "client-abc.123"
    # The error messages use the same mask.
    assert key not in APIError(f"The model {key!r} does not exist.").message


# ------------------------------------------------------------------ TOLLGATE_ADMIN_KEY and the key rule

CANDIDATES = [
    "sk-short",
    "sk-" + "a" * (MIN_LENGTH - 4),  # one short of the minimum
    "sk-" + "a" * (MIN_LENGTH - 3),  # the minimum
    "sk-" + "a" * (MAX_LENGTH - 3),  # the maximum
    "sk-" + "a" * (MAX_LENGTH - 2),
    "sk-abcdefghijklmnopq rs",  # a space: sent in a header it is another key
    "sk-abcdefghijklmnopqrs\n",  # a newline from a file
    "sk-abcdefghijklmnöpqrs",  # not ASCII
    "pk-abcdefghijklmnopqrstu",
    "sk-admin-" + uuid.uuid4().hex,
    generate_key(),
]


@pytest.mark.parametrize("candidate", CANDIDATES, ids=range(len(CANDIDATES)))
def test_admin_key_is_refused_at_start_exactly_when_authentication_would_refuse_it(
    candidate: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.config import load_settings

    monkeypatch.setenv("TOLLGATE_ADMIN_KEY", candidate)
    if looks_like_key(candidate):
        assert key_problem(candidate) is None
        assert load_settings().admin_key == candidate
    else:
        with pytest.raises(SystemExit) as refused:
            load_settings()
        message = str(refused.value)
        assert message.startswith("TOLLGATE_ADMIN_KEY ") and "could never log in" in message
        assert candidate not in message and candidate[3:12] not in message


def test_tollgate_serve_refuses_a_short_admin_key_with_a_clear_message(tmp_path: Path) -> None:
    short = "sk-" + uuid.uuid4().hex[:8]
    # A models file that does not exist: without the refusal, serve would stop there (quickly) instead.
    env = {**os.environ, "TOLLGATE_ADMIN_KEY": short, "TOLLGATE_DATA_DIR": str(tmp_path), "DATABASE_URL": "",
           "TOLLGATE_MODELS": str(tmp_path / "no-such-models.yaml")}
    run = subprocess.run([sys.executable, "-m", "gateway.cli.main", "serve"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0
    assert "TOLLGATE_ADMIN_KEY is 11 characters long; a key has at least 20" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and short not in run.stderr + run.stdout
    assert not (tmp_path / "tollgate.db").exists()  # refused before anything was migrated or stored


async def test_the_shortest_admin_key_accepted_at_start_logs_in_and_ensure_refuses_the_rest(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    await asyncio.to_thread(migrate.upgrade, url)
    db = create_engine(url)
    try:
        keys = KeyStore(db, b"probe-secret")
        shortest = "sk-" + "k" * (MIN_LENGTH - 3)
        assert await keys.ensure_admin_key(shortest) is None
        principal = await keys.authenticate(shortest)
        assert principal is not None and principal.is_admin and looks_like_key(shortest)
        with pytest.raises(ValueError, match="TOLLGATE_ADMIN_KEY is 19 characters long") as refused:
            await keys.ensure_admin_key(shortest[:-1])
        assert shortest[:-1] not in str(refused.value)
    finally:
        await db.dispose()


def test_mask_covers_every_key_the_rule_accepts() -> None:
    for candidate in CANDIDATES:
        if looks_like_key(candidate):
            for text in (candidate, f"model '{candidate}'", f"/v1/models/{candidate}/x", f"id:{candidate}."):
                assert candidate not in mask_keys(text) and candidate[3:12] not in mask_keys(text)
    assert mask_keys("disk-full task-12 ask-me") == "disk-full task-12 ask-me"
    key = "sk-" + "Zq3_" * 11
    for glued in (f"zz{key}", f"9{key}", f"task-{key}"):  # a whole key glued to a word is still a key
        assert key[3:12] not in mask_keys(glued), mask_keys(glued)


def test_stripe_secrets_are_masked_and_read_without_a_files_newline() -> None:
    """The billing settings hold Stripe's secret and webhook secret: a log line or an error quoting one
    (httpcore's DEBUG line quoted the header it refused when the key ended in a newline) shows `***`.
    Read from the environment, they lose the newline a key file leaves, so no header refuses them."""
    secret, restricted, hook = "sk_test_" + "51Hq" * 12, "rk_live_" + "Ab9" * 10, "whsec_" + "c2VjcmV0" * 4
    line = f"send_request_headers.failed exception=LocalProtocolError(\"Illegal header value b'Bearer {secret}\\n'\") {restricted} {hook}"
    masked = mask_keys(line)
    assert secret not in masked and restricted not in masked and hook not in masked and masked.count("***") == 3, masked
    assert mask_keys("task_test_case risk_live_x whsec_ ask_test_") == "task_test_case risk_live_x whsec_ ask_test_"
    words = "task_test_alpha123 disk_live_backup2026 risk_test_20261207"  # glued to a word: no secret (the review)
    assert mask_keys(words) == words
    config = BillingConfig.from_mapping({"TOLLGATE_STRIPE_API_KEY": secret + "\n", "TOLLGATE_STRIPE_WEBHOOK_SECRET": f" {hook}\r\n"})
    assert (config.stripe_api_key, config.stripe_webhook_secret) == (secret, hook)
    assert BillingConfig.from_mapping({"TOLLGATE_STRIPE_API_KEY": "\n"}).stripe_api_key is None


def test_a_batch_input_error_does_not_quote_a_key() -> None:
    """A batch's validation error is stored and shown to whoever reads the batch: a key given as a
    line's custom_id or model is masked, as every other error message masks it."""
    key = "sk-" + "Vq8" * 15
    line = {"method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}
    twice = b"\n".join(orjson.dumps({**line, "custom_id": key}) for _ in range(2))
    other_model = orjson.dumps({**line, "custom_id": "a"}) + b"\n" + orjson.dumps({**line, "custom_id": "b", "body": {"model": key}})
    for content in (twice, other_model):
        with pytest.raises(BadInput) as bad:
            parse_input(content, "/v1/chat/completions", 100)
        assert key[3:12] not in str(bad.value.error()) and MASK in bad.value.error()["message"], bad.value.error()


# ------------------------------------------------------------------ fontTools during PDF renders

def _invoice() -> dict[str, Any]:
    return {
        "number": "TG-2026-10-0001", "account_name": "acme", "account_id": 1, "period": "2026-10",
        "period_start": "2026-10-01T00:00:00+00:00", "period_end": "2026-11-01T00:00:00+00:00", "status": "open",
        "created_at": "2026-11-01T00:00:00+00:00", "currency": "usd", "total": "1.50", "object": "invoice",
        "issued_at": "2026-11-01T00:00:00+00:00", "subtotal_cents": 150, "total_cents": 150, "amount_due_cents": 150,
        "lines": [{"position": 1, "description": "alpha tokens", "usage_period": "2026-10", "tokens": 1000,
                   "unit_price_per_million": "1.500", "amount": "1.50", "amount_cents": 150}],
        "price_versions": [],
    }


def test_rendering_an_invoice_pdf_logs_no_fonttools_info(caplog: pytest.LogCaptureFixture) -> None:
    from billing.invoices import render

    if not any((d / "DejaVuSans.ttf").exists() for d in render.FONT_DIRS):
        pytest.skip("no DejaVu TrueType font here: fpdf2 uses its core font and fontTools never runs")
    caplog.set_level(logging.INFO)  # as the server and the CLI log
    pdf = render.render_pdf(_invoice())
    assert pdf.startswith(b"%PDF")
    from_fonttools = [r for r in caplog.records if r.name.split(".")[0] == "fontTools"]
    assert from_fonttools == [], f"{len(from_fonttools)} fontTools lines, e.g. {from_fonttools[0].getMessage()!r}"
    logging.getLogger("fontTools.subset").warning("still shown")  # its warnings are not silenced
    assert any(r.name == "fontTools.subset" and r.levelno == logging.WARNING for r in caplog.records)


def test_the_cli_renders_a_pdf_without_fonttools_lines_on_stderr(tmp_path: Path) -> None:
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s')\n"  # as gateway.cli.main.main
        "from billing.invoices.render import render_pdf\n"
        f"sys.stdout.buffer.write(render_pdf({_invoice()!r})[:4])\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, timeout=120)
    assert run.returncode == 0 and run.stdout == b"%PDF", run.stderr.decode()[-2000:]
    assert b"fontTools" not in run.stderr, run.stderr.decode()[-2000:]


async def test_a_key_pasted_into_a_path_is_masked_in_the_error_handlers_logs(caplog: pytest.LogCaptureFixture) -> None:
    """The access log masks a key in a path; so do the lines the error handlers write for an outage and
    for an unexpected error on that path (a dashboard document's URL with a key pasted into it)."""
    from starlette.requests import Request

    from gateway.http.error_handlers import unexpected_error

    key = "sk-" + "Zq3_" * 11
    request = Request({"type": "http", "method": "GET", "path": f"/dashboard/invoices/{key}/pdf", "headers": [], "query_string": b""})
    with caplog.at_level(logging.WARNING, logger="tollgate"):
        outage = await unexpected_error(request, ConnectionRefusedError("database down"))
        bug = await unexpected_error(request, RuntimeError("a bug"))
    assert (outage.status_code, bug.status_code) == (503, 500)
    assert len(caplog.records) == 2 and all("sk-***" in r.getMessage() for r in caplog.records)
    assert key not in caplog.text

    # the Anthropic routes answer their own errors (in Anthropic's shape) and log them the same way
    from gateway.api.anthropic.messages import _answered

    async def fails(request: Any, request_id: str) -> Any:
        raise RuntimeError("a bug")

    caplog.clear()
    anthropic_path = Request({"type": "http", "method": "GET", "path": f"/v1/messages/batches/{key}/results", "headers": [],
                              "query_string": b""})
    with caplog.at_level(logging.WARNING, logger="tollgate"):
        answered = await _answered(anthropic_path, fails)
    assert answered.status_code == 500 and len(caplog.records) == 1 and "sk-***" in caplog.records[0].getMessage()
    assert key not in caplog.text
