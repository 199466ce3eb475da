"""Nothing ends a stream silently (issue 26): a response that stops before its end says why at
warning level, with its request id: the client closed, a write failed, or the engine failed."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import httpx
import pytest

from engines.base import FINISH_ERROR
from gateway.serving.generation_response import GenerationResponse
from tests.conftest import MODEL, Gateway

LONG = [{"role": "user", "content": "Write a very long story about a lighthouse keeper and the sea."}]


def early_ends(caplog: pytest.LogCaptureFixture, request_id: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tollgate.responses" and r.levelno == logging.WARNING and request_id in r.getMessage()]


async def test_a_client_that_leaves_mid_stream_is_logged_at_warning(gateway: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    key = await gateway.new_key()
    body = {"model": MODEL, "messages": LONG, "max_tokens": 200, "temperature": 0, "stream": True}
    caplog.set_level(logging.WARNING, logger="tollgate.responses")
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {key['key']}"}, timeout=60) as c:
        async with c.stream("POST", "/chat/completions", json=body) as resp:
            request_id = resp.headers["x-request-id"]
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content"):
                    break
    row = await gateway.ledger_row(request_id)  # barrier: the row is recorded right before the log line is written
    assert row["status"] == "cancelled"
    lines = early_ends(caplog, request_id)
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert "the client closed the connection" in lines[0] and "completion tokens" in lines[0]


async def test_a_complete_stream_logs_nothing(gateway: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    key = await gateway.new_key()
    caplog.set_level(logging.WARNING, logger="tollgate.responses")
    async with httpx.AsyncClient(base_url=gateway.v1, headers={"Authorization": f"Bearer {key['key']}"}, timeout=60) as c:
        r = await c.post("/chat/completions", json={"model": MODEL, "messages": LONG, "max_tokens": 3, "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        request_id = r.headers["x-request-id"]
    await gateway.ledger_row(request_id)
    assert early_ends(caplog, request_id) == []


def test_an_engine_failure_and_a_failed_write_say_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tollgate.responses")
    failed = SimpleNamespace(kind="chat", request_id="req-engine", cancel_requested=False, finish_reason=FINISH_ERROR,
                             error="CUDA error: device-side assert", stream=True, completion_tokens=7, started=0.0, cut=False)
    GenerationResponse(failed, None, {})._report_abnormal_end(write_failed=False)  # type: ignore[arg-type]
    left = SimpleNamespace(kind="chat", request_id="req-write", cancel_requested=True, finish_reason=None, error=None,
                           stream=False, completion_tokens=0, started=0.0, cut=False)
    GenerationResponse(left, None, {})._report_abnormal_end(write_failed=True)  # type: ignore[arg-type]
    assert "the engine failed: CUDA error: device-side assert" in early_ends(caplog, "req-engine")[0]
    assert "a write to the client failed" in early_ends(caplog, "req-write")[0]
