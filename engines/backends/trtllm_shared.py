"""A worker's side of the `trtllm` backend shared by `tollgate serve --workers N`: `SharedLLM`
stands in for `tensorrt_llm.LLM`, talking to the one engine host (engines/backends/trtllm_host.py) over its
socket; the messages and the plain values they carry are defined here.

`TRTLLMEngine` runs unchanged in every worker (admission, stop strings, tool calls, logprobs, n > 1,
metering, SSE): only its `_llm` is a `SharedLLM`, whose `generate_async` returns a result that
iterates, is updated in place and aborts as TensorRT-LLM's does.

    worker -> host: ("generate", rid, prompt ids, _Call(SamplingParams), (account, priority)) | ("abort", rid)
    host -> worker: per engine step one list of ("out", rid, response) | ("fail", rid, error) | ("refused", rid, why, retry_after)

Nothing of tensorrt_llm crosses the socket: sampling parameters travel as the keyword arguments
they are built from (`_Call`), logprobs as plain pairs and errors by their class names (the engine
tells them apart by name: engines/backends/trtllm.py:_is_named), so the workers never import tensorrt_llm.
The workers get the Hugging Face tokenizer inside TensorRT-LLM's wrapper (its `.tokenizer`).
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import logging
import threading
from types import SimpleNamespace
from typing import Any, NamedTuple

from engines.base import EngineOverloadedError

log = logging.getLogger("tollgate.engines.trtllm_shared")

ARGS = ("max_seq_len", "max_num_tokens", "enable_chunked_prefill", "guided_decoding_backend")  # what the workers read of llm.args


class EngineDeadError(RuntimeError):
    """The engine host is gone (the name is TensorRT-LLM's, which engines/backends/trtllm.py:engine_is_dead knows)."""


class Call(NamedTuple):
    """`tensorrt_llm.<name>(**kwargs)`, built in the engine host (SamplingParams, GuidedDecodingParams)."""

    name: str
    kwargs: dict[str, Any]


class _Deferred:
    """The worker's `tensorrt_llm.SamplingParams` / `llmapi.GuidedDecodingParams`: records the call."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, **kwargs: Any) -> Call:
        return Call(self.name, kwargs)


class Logprob(NamedTuple):
    """A logprob entry as TensorRT-LLM's (executor/result.py: logprob, rank)."""

    logprob: float
    rank: int | None


def shared_api() -> SimpleNamespace:
    """What a worker's TRTLLMEngine uses as the `tensorrt_llm` module."""
    return SimpleNamespace(SamplingParams=_Deferred("SamplingParams"), llmapi=SimpleNamespace(GuidedDecodingParams=_Deferred("GuidedDecodingParams")))


def error_named(names: list[str], message: str) -> BaseException:
    """An exception with the same class names as the engine host's (its builtin base kept)."""
    cls: type[BaseException] = Exception
    local = names
    for i, name in enumerate(names):
        found = getattr(builtins, name, None)
        if isinstance(found, type) and issubclass(found, BaseException):
            cls, local = found, names[:i]
            break
    for name in reversed(local):
        cls = type(name, (cls,), {})
    return cls(message)


def names(exc: BaseException) -> list[str]:
    return [c.__name__ for c in type(exc).__mro__]


# the worker's side -----------------------------------------------------------------------------------
class _Output:
    """One CompletionOutput, as much of it as engines/backends/trtllm.py reads."""

    __slots__ = ("index", "token_ids", "text_diff", "token_ids_diff", "logprobs_diff", "finish_reason", "stop_reason")

    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.text_diff = ""
        self.token_ids_diff: list[int] = []
        self.logprobs_diff: list[Any] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class SharedResult:
    """A worker's view of TensorRT-LLM's result: async-iterable, yielding itself updated in place."""

    _outputs: list[_Output] | None = None  # every best_of sequence, when the host's result has more than `outputs`

    def __init__(self, llm: "SharedLLM", rid: str, prompt_ids: list[int]) -> None:
        self._llm, self.rid, self.prompt_token_ids = llm, rid, prompt_ids
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.outputs: list[_Output] = []
        self.finished = False
        self.error: str | None = None
        self.cached_tokens: int | None = None

    def __aiter__(self) -> "SharedResult":
        return self

    async def __anext__(self) -> "SharedResult":
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        self._apply(item)
        return self

    def _apply(self, response: tuple[Any, ...]) -> None:
        self.finished, self.error, self.cached_tokens, outputs, every = response
        self.outputs = _updated(self.outputs, outputs)
        if every is not None:
            self._outputs = _updated(self._outputs or [], every)

    def abort(self) -> None:
        self._llm._abort(self.rid)


def _updated(have: list[_Output], snapshot: list[tuple[Any, ...]]) -> list[_Output]:
    out = []
    for pos, (index, keep, tail, text_diff, ids_diff, logprobs_diff, finish, stop) in enumerate(snapshot):
        o = have[pos] if pos < len(have) else _Output(index)
        o.index, o.token_ids = index, o.token_ids[:keep] + tail
        o.text_diff, o.token_ids_diff, o.logprobs_diff, o.finish_reason, o.stop_reason = text_diff, ids_diff, logprobs_diff, finish, stop
        out.append(o)
    return out


class SharedLLM:
    """A worker's stand-in for `tensorrt_llm.LLM`: the engine host's, over its socket."""

    def __init__(self, address: str) -> None:
        from multiprocessing.connection import Client

        self._conn = Client(address, "AF_UNIX")
        hello = self._conn.recv()
        if hello[0] != "ready":
            self._conn.close()
            raise EngineDeadError(hello[1])
        self.args = SimpleNamespace(**hello[1])
        self.tokenizer = hello[2]
        self._results: dict[str, SharedResult] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closing = False
        self.dead: str | None = None
        threading.Thread(target=self._read, name="tollgate-trtllm-shared", daemon=True).start()

    def generate_async(self, inputs: list[int], sampling_params: Call, streaming: bool = True, *,
                       admission: tuple[Any, str | None] | None = None) -> SharedResult:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        rid = str(next(self._ids))
        result = SharedResult(self, rid, list(inputs))
        self._results[rid] = result
        try:
            self._send(("generate", rid, list(inputs), sampling_params, admission))
        except (OSError, EOFError):
            self._results.pop(rid, None)
            raise EngineDeadError(self.dead or "the shared TensorRT-LLM engine host is gone") from None
        return result

    def _abort(self, rid: str) -> None:
        try:
            self._send(("abort", rid))
        except (OSError, EOFError):
            pass  # the host is gone: nothing of it runs any more

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                break
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[SharedResult, Any]]] = {}
            for kind, rid, *rest in batch:
                result = self._results.get(rid)
                if result is None:
                    continue
                if kind == "out":
                    item: Any = rest[0]
                    if item[0]:
                        self._results.pop(rid, None)
                elif kind == "refused":
                    self._results.pop(rid, None)
                    item = EngineOverloadedError(rest[0], retry_after=rest[1])
                else:
                    self._results.pop(rid, None)
                    item = error_named(*rest)
                by_loop.setdefault(result._loop, []).append((result, item))
            for loop, items in by_loop.items():
                if not loop.is_closed():
                    loop.call_soon_threadsafe(_deliver, items)
        self.dead = "the shared TensorRT-LLM engine host closed its connection"
        if not self._closing:
            log.error("%s; %d requests in flight end with an error", self.dead, len(self._results))
        for result in list(self._results.values()):
            if not result._loop.is_closed():
                result._loop.call_soon_threadsafe(result._queue.put_nowait, EngineDeadError(self.dead))

    def shutdown(self) -> None:
        """This worker leaves: the host aborts what it still had running."""
        self._closing = True
        self._conn.close()


def _deliver(items: list[tuple[SharedResult, Any]]) -> None:
    for result, item in items:
        result._queue.put_nowait(item)
