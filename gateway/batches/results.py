"""What a batch is shown as: OpenAI's Batch object and its output / error files' lines, Anthropic's
MessageBatch and its results lines; and the check of an OpenAI batch input file."""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

import orjson

from billing.batches.store import Line, line_request_id
from billing.keys.format import mask_keys
from gateway.api.anthropic.errors import anthropic_type
from gateway.http.requests import MAX_JSON_DEPTH, too_deep

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages")
OPENAI_ENDPOINTS = ENDPOINTS[:4]
WINDOWS = {"24h": 24 * 3600}
EXPIRED = {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}
CANCELLED = {"code": "batch_cancelled", "message": "This request was not executed: the batch was cancelled."}


class BadInput(ValueError):
    """An input file that is no batch, as OpenAI's batch error (`errors.data[]`): `code` (OpenAI's
    where it has one: invalid_json_line, duplicate_custom_id, url_mismatch, model_mismatch,
    empty_file, too_many_tasks), `line` (1-based; None for the whole file), `param`."""

    def __init__(self, message: str, line: int | None = None, code: str = "invalid_request", param: str | None = None) -> None:
        message = mask_keys(message)  # it may quote a line's custom_id or model: stored, and shown to every reader of the batch
        super().__init__(f"line {line}: {message}" if line else message)
        self.message, self.line, self.code, self.param = message, line, code, param

    def error(self) -> dict[str, Any]:
        return {"code": self.code, "line": self.line, "message": self.message, "param": self.param}


# OpenAI: "/v1/embeddings batches are also restricted to a maximum of 50,000 embedding inputs across
# all requests in the batch" (the Batches API reference).
MAX_EMBEDDING_INPUTS = 50_000


def _embedding_inputs(value: Any) -> int:
    """How many inputs an embeddings body's `input` holds: one string or one token array is one; a list
    of them is as many (what the route refuses, it refuses when the line runs)."""
    if isinstance(value, list) and value and not all(isinstance(v, int) for v in value):
        return len(value)
    return 1


def parse_input(content: bytes, endpoint: str, max_lines: int) -> tuple[list[tuple[str, str]], str]:
    """OpenAI's batch input: one JSON object a line, {"custom_id", "method": "POST", "url", "body"},
    every body for one model. Returns (custom_id, body JSON) per line and the model; raises
    BadInput at the first line that is wrong."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput("the file is not UTF-8 text", code="invalid_json_line") from None
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    model: str | None = None
    inputs = 0
    # Lines end at "\n" (or "\r\n") only: str.splitlines() would also split at U+2028, U+2029, U+0085...,
    # which a JSON string may hold unescaped.
    for number, raw in enumerate(text.split("\n"), 1):
        raw = raw.removesuffix("\r")
        if not raw.strip():
            continue
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise BadInput("This line is not parseable as valid JSON.", number, "invalid_json_line") from None
        if not isinstance(item, dict):
            raise BadInput("each line must be a JSON object", number, "invalid_json_line")
        if too_deep(raw, item):
            raise BadInput(f"nested more than {MAX_JSON_DEPTH} levels deep", number, "invalid_json_line")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 255:
            raise BadInput("custom_id must be a string of 1 to 255 characters", number, param="custom_id")
        if "\x00" in custom_id:  # no database text column can hold one
            raise BadInput("custom_id must not contain NUL characters (\\u0000)", number, param="custom_id")
        if custom_id in seen:
            raise BadInput(f"custom_id {custom_id!r} is used twice; each must be unique", number, "duplicate_custom_id", "custom_id")
        seen.add(custom_id)
        if "method" not in item:  # OpenAI fails such a file too ("missing required 'method'"), rather than assume POST
            raise BadInput("missing required 'method': each line names its method, POST", number, param="method")
        if item["method"] != "POST":
            raise BadInput("method must be POST", number, param="method")
        if item.get("url") != endpoint:
            raise BadInput(f"url must be the batch's endpoint {endpoint!r}", number, "url_mismatch", "url")
        body = item.get("body")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise BadInput("body must be a JSON object with a model", number, param="body.model")
        if "\x00" in body["model"]:  # kept in a text column (the batch's model)
            raise BadInput("body.model must not contain NUL characters (\\u0000)", number, param="body.model")
        if model is None:
            model = body["model"]
        elif body["model"] != model:  # OpenAI: one model per input file
            raise BadInput(f"every line must name the same model: {body['model']!r} here, {model!r} before", number,
                           "model_mismatch", "body.model")
        out.append((custom_id, orjson.dumps(body).decode()))
        if len(out) > max_lines:
            raise BadInput(f"a batch has at most {max_lines} lines", number, "too_many_tasks")
        if endpoint == "/v1/embeddings":
            inputs += _embedding_inputs(body.get("input"))
            if inputs > MAX_EMBEDDING_INPUTS:  # OpenAI's limit, across all of a batch's requests
                raise BadInput(f"an /v1/embeddings batch has at most {MAX_EMBEDDING_INPUTS} inputs across its requests; "
                               f"this line brings them to {inputs}", number, param="body.input")
    if model is None:
        raise BadInput("the file has no requests", code="empty_file")
    return out, model


def _ts(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


def _body(line: Line) -> Any:
    if line.result is None:
        return None
    try:
        return orjson.loads(line.result)
    except orjson.JSONDecodeError:
        return {"error": {"message": line.result[:500], "type": "server_error"}}


def line_total(counts: dict[str, int]) -> int:
    """The batch's lines, from BatchStore.counts (its states; `done:<outcome>` splits `done` again)."""
    return sum(v for k, v in counts.items() if ":" not in k)


def openai_counts(counts: dict[str, int]) -> dict[str, int]:
    """OpenAI's BatchRequestCounts: `failed` is the lines that ran (or that their route refused) without
    a 2xx answer. Lines never run (the batch expired or was cancelled first) are in the error file
    (batch_expired / batch_cancelled) but in neither count, as at OpenAI: an expired batch there read
    {total: 10, completed: 1, failed: 0} with its 9 unrun requests in the error file (warmbly PR #333),
    and its guide calls them "cancelled", not failed. So once the batch has ended, total - completed - failed is what never ran
    (while it runs, the lines still waiting or running are in it too)."""
    return {"total": line_total(counts), "completed": counts.get("done:succeeded", 0), "failed": counts.get("done:errored", 0)}


def openai_usage(tokens: dict[str, int] | None) -> dict[str, Any] | None:
    """OpenAI's BatchUsage from the tokens of the batch's ledger rows."""
    if tokens is None:
        return None
    return {"input_tokens": tokens["prompt"], "input_tokens_details": {"cached_tokens": tokens["cached"]},
            "output_tokens": tokens["completion"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": tokens["prompt"] + tokens["completion"]}


def openai_view(batch: dict[str, Any], counts: dict[str, int], tokens: dict[str, int] | None = None) -> dict[str, Any]:
    """OpenAI's Batch object; `tokens` as BatchStore.tokens gives them."""
    errors = orjson.loads(batch["errors_json"]) if batch.get("errors_json") else None
    return {
        "id": batch["id"], "object": "batch", "endpoint": batch["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": batch["input_file_id"], "completion_window": batch["completion_window"], "status": batch["status"],
        "output_file_id": batch["output_file_id"], "error_file_id": batch["error_file_id"],
        "created_at": _ts(batch["created_at"]), "in_progress_at": _ts(batch["in_progress_at"]),
        "expires_at": _ts(batch["expires_at"]), "finalizing_at": _ts(batch["finalizing_at"]),
        "completed_at": _ts(batch["completed_at"]), "failed_at": _ts(batch["failed_at"]),
        "expired_at": _ts(batch["expired_at"]), "cancelling_at": _ts(batch["cancelling_at"]),
        "cancelled_at": _ts(batch["cancelled_at"]),
        "request_counts": openai_counts(counts),
        "metadata": orjson.loads(batch["metadata_json"]) if batch.get("metadata_json") else None,
        "model": batch.get("model"), "usage": openai_usage(tokens),
    }


def _line_id(line: Line) -> str:
    return "batch_req_" + hashlib.sha256(line_request_id(line.batch_id, line.line).encode()).hexdigest()[:24]


def openai_line(line: Line) -> dict[str, Any]:
    """One line of an output or error file, in OpenAI's shape."""
    if line.outcome in ("succeeded", "errored"):
        response = {"status_code": line.status_code, "request_id": line.request_id, "body": _body(line)}
        return {"id": _line_id(line), "custom_id": line.custom_id, "response": response, "error": None}
    return {"id": _line_id(line), "custom_id": line.custom_id, "response": None,
            "error": EXPIRED if line.outcome == "expired" else CANCELLED}


def openai_files(lines: list[Line]) -> tuple[bytes, bytes]:
    """(output file, error file): the lines that succeeded, and every other line that ended."""
    output, errors = [], []
    for line in lines:
        if line.state != "done":
            continue
        (output if line.outcome == "succeeded" else errors).append(orjson.dumps(openai_line(line)) + b"\n")
    return b"".join(output), b"".join(errors)


# Anthropic ---------------------------------------------------------------------------------------
def anthropic_status(status: str) -> str:
    return {"cancelling": "canceling"}.get(status, "ended" if status in ("completed", "failed", "expired", "cancelled") else "in_progress")


def anthropic_view(batch: dict[str, Any], counts: dict[str, int], base_url: str) -> dict[str, Any]:
    """Anthropic's MessageBatch."""
    status = anthropic_status(batch["status"])
    ended = batch["completed_at"] or batch["expired_at"] or batch["cancelled_at"] or batch["failed_at"]
    return {
        "id": batch["id"], "type": "message_batch", "processing_status": status,
        # Anthropic: a request moves out of `processing` only once the whole batch has ended
        "request_counts": {
            "processing": line_total(counts), "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0,
        } if status != "ended" else {
            "processing": 0, "succeeded": counts.get("done:succeeded", 0), "errored": counts.get("done:errored", 0),
            "canceled": counts.get("done:canceled", 0), "expired": counts.get("done:expired", 0),
        },
        "ended_at": _iso(ended), "created_at": _iso(batch["created_at"]), "expires_at": _iso(batch["expires_at"]),
        "archived_at": None, "cancel_initiated_at": _iso(batch["cancelling_at"]),
        "results_url": f"{base_url.rstrip('/')}/v1/messages/batches/{batch['id']}/results" if status == "ended" else None,
    }


def anthropic_line(line: Line) -> dict[str, Any]:
    """One line of a MessageBatch's results."""
    if line.outcome == "succeeded":
        return {"custom_id": line.custom_id, "result": {"type": "succeeded", "message": _body(line)}}
    if line.outcome == "errored":
        body = _body(line) or {}
        if body.get("type") == "error":  # the route's own answer, in Anthropic's shape
            error = body
        else:  # the runner's (an OpenAI-shaped body: the key revoked, the line interrupted): typed by its status
            message = str((body.get("error") or {}).get("message", "the request failed"))
            error = {"type": "error", "error": {"type": anthropic_type(line.status_code or 500), "message": message},
                     "request_id": line.request_id}
        return {"custom_id": line.custom_id, "result": {"type": "errored", "error": error}}
    return {"custom_id": line.custom_id, "result": {"type": "canceled" if line.outcome == "canceled" else "expired"}}
