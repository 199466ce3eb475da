"""A Message Batch as Anthropic shows it (gateway/batches/results.py), from stored lines and counts:
request counts move out of `processing` only once the batch has ended, and a line the runner ended
itself (an OpenAI-shaped body: a revoked key, an interruption) is typed by its status, as Anthropic
types an errored result's error, with the request's id."""

from __future__ import annotations

from datetime import datetime, timezone

import orjson
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse

from billing.batches.store import Line
from gateway.batches.results import anthropic_line, anthropic_view
from gateway.batches.runner import INTERRUPTED, KEY_REVOKED

NOW = datetime(2026, 12, 7, tzinfo=timezone.utc)


def batch(status: str, **ended: datetime) -> dict[str, object]:
    return {"id": "msgbatch_1", "status": status, "created_at": NOW, "expires_at": NOW, "cancelling_at": None,
            "completed_at": None, "expired_at": None, "cancelled_at": None, "failed_at": None, **ended}


def test_request_counts_stay_processing_until_the_batch_ends() -> None:
    counts = {"pending": 2, "claimed": 1, "done": 4, "done:succeeded": 3, "done:errored": 1}
    running = MessageBatch.model_validate(anthropic_view(batch("in_progress"), counts, "http://gw"))
    assert running.processing_status == "in_progress" and running.results_url is None
    assert running.request_counts.model_dump() == {"processing": 7, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    ended_counts = {"done": 7, "done:succeeded": 5, "done:errored": 1, "done:canceled": 1}
    ended = MessageBatch.model_validate(anthropic_view(batch("completed", completed_at=NOW), ended_counts, "http://gw"))
    assert ended.request_counts.model_dump() == {"processing": 0, "succeeded": 5, "errored": 1, "canceled": 1, "expired": 0}


def test_a_line_the_runner_ended_is_typed_by_its_status() -> None:
    def result(status: int, body: dict[str, object]) -> MessageBatchIndividualResponse:
        line = Line("msgbatch_1", 3, "c-3", "{}", "done", "errored", status, orjson.dumps(body).decode())
        return MessageBatchIndividualResponse.model_validate(anthropic_line(line))

    revoked = result(401, KEY_REVOKED).result
    assert revoked.type == "errored" and revoked.error.error.type == "authentication_error"  # type: ignore[union-attr]
    assert revoked.error.error.message == "The batch's API key is no longer valid."  # type: ignore[union-attr]
    assert revoked.error.request_id == Line("msgbatch_1", 3, "c", "", "", None, None, None).request_id  # type: ignore[union-attr]
    assert result(500, INTERRUPTED).result.error.error.type == "api_error"  # type: ignore[union-attr]
    routed = {"type": "error", "error": {"type": "not_found_error", "message": "no such model"}, "request_id": "r"}
    assert result(404, routed).result.error.model_dump() == routed  # type: ignore[union-attr]  # the route's own answer, as it was
