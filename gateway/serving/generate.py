"""A prepared generation from here to its response, the same for every API that generates:
chat and text completions, Anthropic Messages, OpenAI Responses.

    response_cache.lookup()  a stored completion for it (Hit), what stores its own (Miss), or None
    admit() / admit_hit()    one Admission: what the request holds (gateway/serving/admission.py)
    the response             streamed or one body, in the API's shapes; its `finally` settles the admission
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from engines.base import EngineOutput
from gateway.serving import cache as response_cache
from gateway.batches.line import batch_line
from gateway.serving.admission import Admission, overloaded
from gateway.serving.completions import CompletionService, Generation
from starlette.requests import Request

# streamed(outputs, headers, admission) -> the API's response over engine outputs
Streamed = Callable[[AsyncIterator[EngineOutput], dict[str, str], Admission], Any]
# completed(headers, admission) -> the API's one-body response through the engine's native complete()
Completed = Callable[[dict[str, str], Admission], Any]


async def answer(
    request: Request, service: CompletionService, gen: Generation, *, streamed: Streamed, completed: Completed,
    headers: dict[str, str] | None = None,
) -> Any:
    line = batch_line(request.scope)
    if line is not None:  # a line of a batch: its own row (api = batch), never a cache hit
        gen.api, gen.batch_id = "batch", line.batch_id
    found = await response_cache.lookup(request, gen) if line is None else None
    hit = found if isinstance(found, response_cache.Hit) else None
    miss = found if isinstance(found, response_cache.Miss) else None
    if hit is not None:  # never reaches the engine: no place in it is taken
        refused = gen.engine.refusal(gen.engine_request)  # but an engine that turns work away refuses hits too
        if refused is not None:
            raise overloaded(refused)
        admission = await service.admit_hit(gen, hit.prompt_tokens, hit.completion_tokens, hit.hit_price)
    else:
        admission = await service.admit(gen, line)
    # Admitted from here on: the response settles the admission; until it exists, this does.
    try:
        head = {"x-request-id": gen.request_id, **(headers or {}), **admission.headers}
        if hit is not None:
            head[response_cache.HEADER] = "hit"
            return streamed(response_cache.replayed(gen, hit, admission), head, admission)
        if miss is None and not gen.stream and gen.engine.completes:
            return completed(head, admission)  # one body from a chain that answers as one coroutine
        outputs = service.metered(gen, admission)
        return streamed(miss.recording(gen, outputs) if miss is not None else outputs, head, admission)
    except BaseException:
        admission.settle("error")
        raise
