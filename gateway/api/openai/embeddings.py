"""POST /v1/embeddings: OpenAI's embeddings endpoint, metered like completions.

    input            a string, a list of strings, a list of token ids, or a list of those lists
    encoding_format  "float" (default) or "base64" (little-endian float32, what the SDKs request)
    dimensions       the native size, or fewer where the model is Matryoshka-trained

Admission tokenizes every input, refuses one longer than the model takes, then reserves the
input tokens (and their price) on the key and the account, like a completion's prompt. The
vectors come from the model's micro-batcher (engines/backends/embeddings.py), so concurrent requests
share forward passes. Whatever happens after admission, the request gets one ledger row:
`prompt_tokens` = input tokens, `completion_tokens` = 0, priced at the model's input price.

Settings (`Settings.embeddings`, from the environment): TOLLGATE_EMBEDDINGS=off serves no embedding model;
TOLLGATE_EMBEDDING_MODEL names the embedded default (all-minilm-l6-v2);
TOLLGATE_EMBEDDING_BATCH (64) and TOLLGATE_EMBEDDING_BATCH_WAIT_MS (2) shape the batcher.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engines.base import EngineError
from engines.backends.embeddings import EmbeddingModel
from gateway.config import EmbeddingSettings
from gateway.http.json_response import json_response
from gateway.serving.admission import Meter, Usage
from gateway.batches.line import batch_line
from gateway.http.errors import ContextLengthExceeded, EngineNotReady, InvalidRequest, ModelNotFound, PermissionDenied, ServiceUnavailable
from gateway.http.requests import authenticate, read_json
from gateway.http.logs import request_id_of

log = logging.getLogger("tollgate.embeddings")
MAX_INPUTS = 2048


@dataclass
class EmbeddingRequest:
    model: str
    inputs: list[str | list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None


def parse_embedding_request(body: Any) -> EmbeddingRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("missing required parameter: 'model'", param="model", code="missing_required_parameter")
    if "input" not in body:
        raise InvalidRequest("missing required parameter: 'input'", param="input", code="missing_required_parameter")
    raw = body["input"]
    if isinstance(raw, str):
        inputs: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(_is_token(t) for t in raw):
        inputs = [raw]  # one input given as token ids
    elif isinstance(raw, list) and raw:
        inputs = raw
    else:
        raise InvalidRequest("'input' must be a non-empty string, list of strings, or list of token ids", param="input")
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequest(f"at most {MAX_INPUTS} inputs are allowed per request", param="input")
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"input[{i}] must not be empty", param="input")
        elif not (isinstance(item, list) and item and all(_is_token(t) for t in item)):
            raise InvalidRequest(f"input[{i}] must be a non-empty string or a non-empty list of token ids", param="input")
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt  # explicit: `false` or `0` is not a format
    if fmt not in ("float", "base64"):
        raise InvalidRequest("'encoding_format' must be 'float' or 'base64'", param="encoding_format", code="invalid_value")
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise InvalidRequest("'dimensions' must be a positive integer", param="dimensions", code="invalid_value")
    return EmbeddingRequest(model=model, inputs=inputs, encoding_format=fmt, dimensions=dims)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class EmbeddingService:
    def __init__(self, models: dict[str, EmbeddingModel]) -> None:
        self.models = models

    @classmethod
    def from_settings(cls, settings: EmbeddingSettings) -> "EmbeddingService":
        if not settings.enabled:
            return cls({})
        model = EmbeddingModel(
            settings.model, settings.model_path, max_batch_size=settings.batch, batch_wait_ms=settings.batch_wait_ms
        )
        return cls({model.model_id: model})

    def model_for(self, name: str, principal: Any) -> EmbeddingModel:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(f"The embedding model {name!r} does not exist.", param="model")
        if not principal.may_use(name):
            raise PermissionDenied(f"This API key may not use the model {name!r}.", param="model", code="model_not_allowed")
        return model

    async def start(self) -> None:
        for model in self.models.values():
            await model.start()

    async def stop(self) -> None:
        for model in self.models.values():
            await model.stop()


def token_ids(model: EmbeddingModel, inputs: list[str | list[int]]) -> list[list[int]]:
    out = []
    vocab = model.vocab_size
    for i, item in enumerate(inputs):
        ids = model.encode_text(item) if isinstance(item, str) else list(item)
        if not ids:
            raise InvalidRequest(f"input[{i}] has no tokens", param="input")
        if any(t < 0 or t >= vocab for t in ids):
            raise InvalidRequest(f"input[{i}]: token ids must be in [0, {vocab})", param="input")
        if len(ids) > model.max_input_tokens:
            raise ContextLengthExceeded(
                f"This model's maximum input length is {model.max_input_tokens} tokens; input[{i}] has {len(ids)} tokens.",
                param="input",
            )
        out.append(ids)
    return out


def shape(vector: list[float], dimensions: int | None, model: EmbeddingModel) -> list[float]:
    if dimensions is None or dimensions == len(vector):
        return vector
    if not model.matryoshka or dimensions > len(vector):
        raise InvalidRequest(
            f"The model {model.model_id!r} only supports dimensions={model.dimensions}.", param="dimensions", code="invalid_value"
        )
    cut = np.asarray(vector[:dimensions], dtype=np.float64)
    norm = float(np.linalg.norm(cut)) or 1.0
    return (cut / norm).tolist()


def encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embeddings(request: Request) -> Response:
    state = request.app.state
    service: EmbeddingService | None = state.embeddings
    request_id = request_id_of(request)
    principal = await authenticate(request, state.keys, states=state.billing.states)  # 403 for a suspended account
    body = parse_embedding_request(await read_json(request, state.settings.http.max_body_bytes))
    if service is None:
        raise ModelNotFound(f"The embedding model {body.model!r} does not exist.", param="model")
    model = service.model_for(body.model, principal)
    if not model.ready:
        try:
            await asyncio.wait_for(model.start(), timeout=60)
        except Exception:
            raise EngineNotReady(f"The model {body.model!r} is still loading; retry shortly.", headers={"Retry-After": "5"}) from None
    if body.dimensions is not None and body.dimensions != model.dimensions:
        shape([0.0] * model.dimensions, body.dimensions, model)  # raises the 400 before any quota is held
    ids = token_ids(model, body.inputs)
    tokens = sum(len(x) for x in ids)

    meter: Meter = state.service.meter
    line = batch_line(request.scope)  # a line of a batch: api = batch, the batch price
    # Billed whole or not at all: its input tokens at the input price if it completes, else nothing.
    usage = Usage(api="embeddings" if line is None else "batch", batch_id=None if line is None else line.batch_id, prompt_tokens=tokens,
                  whole=True)
    admission = await meter.admit(request_id, principal, model.model_id, usage, tokens=tokens, cost=lambda price: price.cost_nanos(tokens, 0),
                                  line=line)
    usage.started = time.perf_counter()
    # Its row: `completed` once the body is made, `error` on any failure (the model's or the server's
    # own), `cancelled` only when the request itself is cancelled (the client left).
    status: str | None = None
    try:
        try:
            vectors = await model.embed(ids)
        except EngineError as exc:
            raise ServiceUnavailable(f"The embedding model failed this request: {exc}", code="engine_error") from None
        data = [
            {"object": "embedding", "index": i, "embedding": encode(shape(v, body.dimensions, model), body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        payload = {"object": "list", "data": data, "model": model.model_id, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        response = json_response(payload, headers={"x-request-id": request_id, **admission.headers})
        status = "completed"
    except Exception:
        status = "error"
        raise
    finally:
        admission.settle(status)
    return response


async def start(app: Any) -> None:
    """Builds the embedding service and loads its models in the background (lifespan hook)."""
    service = app.state.embeddings or EmbeddingService.from_settings(app.state.settings.embeddings)
    app.state.embeddings = service
    app.state.embeddings_loading = asyncio.get_running_loop().create_task(_load(service), name="load-embeddings")


async def _load(service: EmbeddingService) -> None:
    try:
        await service.start()
    except Exception:
        log.exception("embedding model failed to load")


async def stop(app: Any) -> None:
    loading = app.state.embeddings_loading
    if loading is not None:
        loading.cancel()
    service = app.state.embeddings
    if service is not None:
        await service.stop()


routes = [Route("/v1/embeddings", create_embeddings, methods=["POST"])]
