"""`trtllm` backend: TensorRT-LLM's LLM API in this process (its PyTorch backend, 1.x).

    LLM(model=<HF checkpoint dir>, tensor_parallel_size, max_batch_size, max_seq_len, max_num_tokens,
        kv_cache_config=KvCacheConfig(free_gpu_memory_fraction), scheduler_config=...)
    async for out in llm.generate_async(prompt_ids, sampling_params, streaming=True):
        out.outputs[0].text_diff / token_ids_diff   the increment
        out.prompt_token_ids / outputs[0].token_ids  the counts
        outputs[0].finish_reason                     stop | length | timeout | cancelled
    out.abort()                                      on client disconnect

TensorRT-LLM does the in-flight batching; this module only maps requests and outputs. The names
used here are checked against the contract read from NVIDIA's source
(tests/contracts/trtllm_contract.json, tests/engines/backends/test_trtllm_contract.py). The package is an
optional extra (`tollgate[trtllm]`) imported lazily: without it, selecting this backend fails at
start-up with one message (`require_tensorrt_llm`).

Each request's result is read by a small pump task into a queue, so the request's stream can end
on a cancel even when TensorRT-LLM never answers again (it drops an aborted request that is still
in its waiting queue without any output).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.base import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TIMEOUT,
    Engine,
    EngineError,
    EngineOutput,
    EngineOverloadedError,
    EngineRequest,
    EngineRequestRejected,
)
from engines.decoding.text import StopMatcher
from engines.decoding.tool_calls import PARSERS, ToolCall, parser_for

log = logging.getLogger("tollgate.engines.trtllm")

MISSING = (
    "the trtllm backend needs TensorRT-LLM (the `tensorrt_llm` package), which is not installed here. "
    "Install it on a CUDA machine with `pip install 'tollgate[trtllm]'` (the wheel comes from NVIDIA's "
    "package index), or serve the model with trtllm-serve and use the `openai` backend."
)
# TensorRT-LLM's finish reasons in OpenAI's terms. `timeout` ends a request early, as `length` does.
FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "timeout": FINISH_LENGTH, "cancelled": FINISH_CANCELLED}
SCHEDULER_POLICIES = {"guaranteed_no_evict": "GUARANTEED_NO_EVICT", "max_utilization": "MAX_UTILIZATION"}
# What Tollgate passes as max_batch_size when models.yaml sets none (TensorRT-LLM's own default is
# 2048): the batch the engine runs and the slots Tollgate schedules are then the same number.
DEFAULT_MAX_BATCH_SIZE = 256
# TensorRT-LLM's max_num_tokens default (TorchLlmArgs), for an LLM whose args do not say.
DEFAULT_MAX_NUM_TOKENS = 8192
# OpenAI's limit on top_logprobs (TensorRT-LLM takes up to 100).
MAX_TOP_LOGPROBS = 20
# The most choices (n, or best_of sequences) one request may ask for: each sequence takes a slot of
# TensorRT-LLM's batch, while Tollgate's scheduler counts the request as one.
MAX_CHOICES = 16
# After a cancel, how long a request that has produced output gets to send its own final
# `cancelled` output (its exact counts) before the stream ends without it.
CANCEL_GRACE_S = 1.0
# Seconds a request may wait for its next output while no request of the engine gets any: then the
# executor is taken for gone. TensorRT-LLM 1.0-1.2 has no EngineDeadError: a dead worker's results
# just never answer again.
DEFAULT_OUTPUT_TIMEOUT_S = 120.0


class TensorRTLLMMissing(EngineError):
    """The `tensorrt_llm` package cannot be imported."""


def require_tensorrt_llm() -> None:
    """Fails at start-up, before any model loads, when the package is absent."""
    if sys.modules.get("tensorrt_llm") is not None:
        return  # already imported
    if importlib.util.find_spec("tensorrt_llm") is None:
        raise TensorRTLLMMissing(MISSING)


def import_tensorrt_llm() -> Any:
    try:
        return importlib.import_module("tensorrt_llm")
    except ImportError as exc:
        raise TensorRTLLMMissing(f"{MISSING} (import failed: {exc})") from None


def _is_named(exc: BaseException, name: str) -> bool:
    """Whether the exception is (a subclass of) TensorRT-LLM's class of that name; by name, so
    that nothing of tensorrt_llm's internals needs importing."""
    return any(cls.__name__ == name for cls in type(exc).__mro__)


class ExecutorStalled(TimeoutError):
    """No request of the engine got any output for `output_timeout` seconds."""


def engine_is_dead(exc: BaseException) -> bool:
    """TensorRT-LLM's executor is gone: a worker died (EngineDeadError on the result), the LLM
    is shutting down (RuntimeError from generate_async), or nothing answers any more (ExecutorStalled)."""
    if _is_named(exc, "EngineDeadError") or isinstance(exc, ExecutorStalled):
        return True
    return isinstance(exc, RuntimeError) and "shutting down" in str(exc).lower()


def request_is_invalid(exc: BaseException) -> bool:
    """TensorRT-LLM refused the request itself: RequestError (e.g. a prompt over max_num_tokens),
    or a ValueError/TypeError from its argument checks."""
    return _is_named(exc, "RequestError") or isinstance(exc, (ValueError, TypeError))


def chat_template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: text content parts joined, `developer` as `system`.
    Anything but text parts is refused (ValueError: the gateway answers 400)."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"messages[{i}].content[{j}]: content part type {kind!r} is not supported by this model; only 'text' parts are")
                parts.append(part["text"])
            m = {**m, "content": "".join(parts)}
        if m.get("role") == "developer":
            m = {**m, "role": "system"}
        out.append(m)
    return out


def _rejected(message: str, param: str, code: str = "unsupported_parameter") -> EngineRequestRejected:
    return EngineRequestRejected(message, param=param, code=code)


@dataclass(slots=True)
class _Step:
    """One TensorRT-LLM response, copied out of the result object it updates in place."""

    text: str
    token_ids: list[int]
    count: int  # len(outputs[0].token_ids): cumulative, after any trimming
    prompt_tokens: int
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None
    logprobs: list[Any] | None
    cached_tokens: int | None


_CANCELLED = object()  # the stream was cancelled; end it now
_ENDED = object()  # the result stopped iterating without a finished output


@dataclass(slots=True)
class _Failure:
    exc: BaseException


class _Live:
    """One request TensorRT-LLM holds: its result, the queue its pump fills, the cancel timer."""

    __slots__ = ("result", "queue", "pump", "seen_output", "timer", "done")

    def __init__(self, result: Any) -> None:
        self.result = result
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.pump: asyncio.Task[None] | None = None
        self.seen_output = False
        self.timer: asyncio.TimerHandle | None = None
        self.done = False  # the stream ended by itself (nothing to abort)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()


async def _pump(live: _Live, step: Callable[[Any], Any], saw: Callable[[], None]) -> None:
    """Copies each response of the result into the queue, as `step` makes it (the result is one
    object updated in place); a failure is handed to the stream, which decides. `saw`: the engine
    got an output (its stall watch)."""
    try:
        async for out in live.result:
            saw()
            live.queue.put_nowait(step(out))
            if out.finished:
                return
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - handed to the stream, which decides
        live.queue.put_nowait(_Failure(exc))
        return
    live.queue.put_nowait(_ENDED)


def _one_sequence(live: _Live, want_logprobs: bool) -> Callable[[Any], _Step]:
    """The step of a request with one sequence: its diffs since the last response."""

    def step(out: Any) -> _Step:
        c = out.outputs[0]
        ids = list(c.token_ids_diff)
        live.seen_output = live.seen_output or bool(ids)
        return _Step(
            c.text_diff, ids, len(c.token_ids), len(out.prompt_token_ids), out.finished, c.finish_reason,
            c.stop_reason, getattr(out, "error", None), list(c.logprobs_diff) if want_logprobs else None,
            getattr(out, "cached_tokens", None),
        )

    return step


@dataclass(slots=True)
class _Many:
    """One TensorRT-LLM response of a request with several sequences (n / best_of > 1): what changed
    in each visible output (index, new ids, length after any trimming, finish_reason, stop_reason),
    the tokens of every generated sequence, and on the last the final ids of each visible output."""

    updates: list[tuple[int, list[int], int, str | None, int | str | None]]
    total: int  # completion tokens of every sequence the engine generated (best_of of them)
    prompt_tokens: int
    finished: bool
    error: str | None
    cached_tokens: int | None
    final: list[tuple[int, list[int], str | None, int | str | None]] | None


def _all_sequences(result: Any) -> list[Any]:
    """Every sequence the engine generates for the request. With best_of > n the public `outputs`
    shows only the n best (re-indexed as they rank); result.py keeps all best_of in `_outputs`
    (read at the contract's commit: GenerationResultBase.__init__), which is what was computed."""
    every = getattr(result, "_outputs", None)
    return list(every) if isinstance(every, list) and every else list(result.outputs)


def _many_sequences(live: _Live) -> Callable[[Any], _Many]:
    """The step of a request with several sequences. TensorRT-LLM answers one sequence per response
    (`sequence_index`) and leaves the other outputs' diffs as they were, so the lengths seen are kept
    here per index instead of trusting `token_ids_diff`/`text_diff` of outputs a response did not touch."""
    lengths: dict[int, int] = {}

    def step(out: Any) -> _Many:
        updates = []
        for c in out.outputs:
            ids = c.token_ids or []
            seen = lengths.get(c.index, 0)
            if len(ids) != seen or c.finish_reason is not None:
                updates.append((c.index, list(ids[seen:]), len(ids), c.finish_reason, c.stop_reason))
                lengths[c.index] = len(ids)
        total = sum(len(c.token_ids or ()) for c in _all_sequences(out))
        live.seen_output = live.seen_output or total > 0
        final = [(c.index, list(c.token_ids or ()), c.finish_reason, c.stop_reason) for c in out.outputs] if out.finished else None
        return _Many(updates, total, len(out.prompt_token_ids), out.finished, getattr(out, "error", None),
                     getattr(out, "cached_tokens", None), final)

    return step


class _Choice:
    """One choice of a request with n > 1: its ids, decoded here incrementally (a window of ids, so
    that a character split across tokens waits for its last byte), and its own stop strings."""

    __slots__ = ("ids", "prefix", "read", "stops", "text", "finish", "opened")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.stops = StopMatcher(stops)
        self.text: list[str] = []
        self.finish: str | None = None
        self.opened = False

    def decode(self, tokenizer: Any, flush: bool) -> str:
        before = tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(after) > len(before) and (flush or not after.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""


class _Shape:
    """The client's view of a request that needs more than text: logprobs and/or tool calls. Each
    output gets the OpenAI choice object it becomes (EngineOutput.raw_choice): a chunk's choice
    with `delta` when streaming; when not, the outputs carry text only and the final one the whole
    choice (`message`, every tool call and logprob)."""

    def __init__(self, engine: TRTLLMEngine, chat: bool, stream: bool, logprobs: bool, tools: bool) -> None:
        self.engine = engine
        self.chat = chat
        self.stream = stream
        self.logprobs = logprobs
        self.parser = parser_for(engine.tool_parser) if tools and engine.tool_parser else None
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self.entries: list[Any] = []
        self.offset = 0  # text_offset of the next token (text completions)

    @classmethod
    def for_request(cls, engine: TRTLLMEngine, request: EngineRequest, tools: bool) -> "_Shape | None":
        body = request.extra or {}
        logprobs = engine.logprobs_wanted(request) is not None
        if not logprobs and not tools:
            return None  # plain text: the gateway renders it
        return cls(engine, "messages" in body, body.get("stream") is True, logprobs, tools)

    def _token(self, token_id: int) -> str:
        return self.engine._tokenizer.decode([token_id])

    def _entries(self, step: _Step) -> list[Any]:
        if not self.logprobs or not step.logprobs:
            return []
        out = []
        for token_id, alternatives in zip(step.token_ids, step.logprobs):
            if isinstance(alternatives, dict):
                ranked = sorted(alternatives.items(), key=lambda kv: (getattr(kv[1], "rank", None) or 1 << 30))
                sampled = alternatives.get(token_id)
                lp = float(getattr(sampled, "logprob", sampled)) if sampled is not None else float("-inf")
            else:  # the simple format: the sampled token's logprob only
                ranked, lp = [], float(alternatives)
            token = self._token(token_id)
            top = [(self._token(t), float(getattr(v, "logprob", v))) for t, v in ranked
                   if getattr(v, "rank", None) is not None and (t != token_id or getattr(v, "rank", None) == 1)][:MAX_TOP_LOGPROBS]
            if self.chat:
                out.append({"token": token, "logprob": lp, "bytes": list(token.encode()),
                            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top]})
            else:
                out.append((token, lp, dict(top), self.offset))
                self.offset += len(token)
        return out

    def _logprobs_body(self, entries: list[Any]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": entries}
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}

    def shaped(self, out: EngineOutput, step: _Step) -> EngineOutput:
        text, calls = out.text, []
        if self.parser is not None:
            text, calls = self.parser.push(text)
            if out.finished:
                rest, more = self.parser.finish()
                text, calls = text + rest, calls + more
        entries = self._entries(step)
        first_call = len(self.calls)
        self.calls += calls
        out.text = text
        finish = None
        if out.finished:
            finish = "tool_calls" if self.calls and out.finish_reason == FINISH_STOP else out.finish_reason
        if self.stream:
            if not (text or calls or entries or out.finished):
                return out
            if self.chat:
                delta: dict[str, Any] = {"content": text} if text else {}
                if calls:
                    delta["tool_calls"] = [c.openai(first_call + i) for i, c in enumerate(calls)]
                out.raw_choice = {"index": 0, "delta": delta, "logprobs": self._logprobs_body(entries) if entries else None, "finish_reason": finish}
            else:
                out.raw_choice = {"index": 0, "text": text, "logprobs": self._logprobs_body(entries) if entries else None, "finish_reason": finish}
            return out
        self.content.append(text)
        self.entries += entries
        if out.finished:
            content = "".join(self.content)
            logprobs = self._logprobs_body(self.entries)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None}
                if self.calls:
                    message["tool_calls"] = [c.openai(i) for i, c in enumerate(self.calls)]
                    for call in message["tool_calls"]:
                        call.pop("index")
                out.raw_choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
            else:
                out.raw_choice = {"index": 0, "text": content, "logprobs": logprobs, "finish_reason": finish}
        return out


class TRTLLMEngine(Engine):
    owned_by = "tollgate-trtllm"
    # The engine takes the client's fields itself (penalties, logprobs, response_format, tools):
    # the gateway's unsupported-parameter checks are skipped and `check_fields` refuses the rest.
    passthrough = True

    def __init__(
        self,
        *,
        model_id: str,
        model_path: str,
        context_length: int | None = None,
        tensor_parallel_size: int = 1,
        max_batch_size: int | None = None,
        max_num_tokens: int | None = None,
        kv_cache_free_gpu_memory_fraction: float | None = None,
        scheduler_policy: str | None = None,
        max_queue: int = 256,
        llm_options: dict[str, Any] | None = None,
        tool_parser: str | None = None,
        output_timeout: float = DEFAULT_OUTPUT_TIMEOUT_S,
        api: Any = None,
    ) -> None:
        """`api` is the `tensorrt_llm` module; None imports it at start. `llm_options` go to
        `LLM(...)` as they are (e.g. cuda_graph_config), after the settings named here."""
        if scheduler_policy is not None and scheduler_policy not in SCHEDULER_POLICIES:
            raise ValueError(f"scheduler_policy must be one of {', '.join(SCHEDULER_POLICIES)}")
        if tool_parser is not None and tool_parser not in PARSERS:
            raise ValueError(f"tool_parser must be one of {', '.join(PARSERS)}")
        self.tool_parser = tool_parser
        self.model_id = model_id
        self.model_path = model_path
        self.context_length = context_length or 0
        self._configured_context = context_length
        self.tensor_parallel_size = tensor_parallel_size
        self.max_batch_size = max_batch_size or DEFAULT_MAX_BATCH_SIZE
        self.max_num_tokens = max_num_tokens
        self.kv_cache_free_gpu_memory_fraction = kv_cache_free_gpu_memory_fraction
        self.scheduler_policy = scheduler_policy
        self.llm_options = dict(llm_options or {})
        self.max_queue = max_queue
        self.capacity = self.max_batch_size + max_queue
        self.max_choices = min(MAX_CHOICES, self.max_batch_size)  # n / best_of: SamplingParams(n, best_of)
        # The longest prompt TensorRT-LLM takes: max_num_tokens unless chunked prefill is on (None).
        self.max_prompt_tokens: int | None = None
        self._api = api
        self._llm: Any = None
        self._tokenizer: Any = None
        self._live: dict[str, _Live] = {}  # request id -> what TensorRT-LLM holds for it
        self._ready = False
        self.output_timeout = output_timeout
        self._last_output = 0.0  # monotonic time of the engine's latest output (or of going busy)
        # `serve --workers N`: the engine host's socket (gateway/serving/engine_hosts.py); the LLM is that host's
        # (engines/backends/trtllm_shared.py:SharedLLM) and its queue lets this worker's requests into the one batch.
        self.connect_to: str | None = None

    # lifecycle --------------------------------------------------------------------------------
    @property
    def renders_tools(self) -> bool:
        return self.tool_parser is not None

    def tool_encoder(self) -> Callable[[list[dict[str, Any]], list[Any]], list[int]]:
        return self.encode_chat  # the chat template renders tools with or without a parser

    @property
    def ready(self) -> bool:
        # A shared engine host that is gone (SharedLLM.dead) is not ready before any request finds out.
        return self._ready and getattr(self._llm, "dead", None) is None

    def _checkpoint_context(self) -> int | None:
        config = Path(self.model_path) / "config.json"
        if config.exists():
            value = json.loads(config.read_text()).get("max_position_embeddings")
            if value:
                return int(value)
        return None

    def llm_kwargs(self, api: Any) -> dict[str, Any]:
        """The keyword arguments for `tensorrt_llm.LLM`, from this engine's settings. The batch size
        and (when known here) the sequence length are always passed, so that the engine's capacity
        and context are the ones Tollgate schedules and admits by."""
        llmapi = getattr(api, "llmapi", None) or importlib.import_module("tensorrt_llm.llmapi")
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_batch_size": self.max_batch_size,
        }
        max_seq_len = self._configured_context or self._checkpoint_context()
        if max_seq_len:
            kwargs["max_seq_len"] = max_seq_len
        if self.max_num_tokens is not None:
            kwargs["max_num_tokens"] = self.max_num_tokens
        if self.kv_cache_free_gpu_memory_fraction is not None:
            kwargs["kv_cache_config"] = llmapi.KvCacheConfig(free_gpu_memory_fraction=self.kv_cache_free_gpu_memory_fraction)
        if self.scheduler_policy is not None:
            policy = getattr(llmapi.CapacitySchedulerPolicy, SCHEDULER_POLICIES[self.scheduler_policy])
            kwargs["scheduler_config"] = llmapi.SchedulerConfig(capacity_scheduler_policy=policy)
        kwargs.update(self.llm_options)
        return kwargs

    async def start(self) -> None:
        if self._ready:
            return
        started = time.perf_counter()
        if self.connect_to is not None:
            from engines.backends.trtllm_shared import SharedLLM, shared_api

            address = self.connect_to
            self._llm = await asyncio.to_thread(SharedLLM, address)
            self._api = shared_api()
            max_seq_len = self._configured_context or self._checkpoint_context()  # as llm_kwargs passes it
        else:
            api = self._api if self._api is not None else import_tensorrt_llm()
            self._api = api
            kwargs = self.llm_kwargs(api)
            # Building the executor loads weights and captures CUDA graphs: minutes, off the loop.
            self._llm = await asyncio.to_thread(lambda: api.LLM(**kwargs))
            max_seq_len = kwargs.get("max_seq_len")
        self._tokenizer = self._llm.tokenizer
        self.context_length = self._resolve_context_length(max_seq_len)
        self.max_prompt_tokens = self._resolve_prompt_limit()
        self._ready = True
        log.info("model %s ready on TensorRT-LLM in %.1fs", self.model_id, time.perf_counter() - started)

    def _resolve_context_length(self, passed: int | None) -> int:
        if passed:
            return int(passed)
        max_seq_len = getattr(getattr(self._llm, "args", None), "max_seq_len", None)
        if max_seq_len:
            return int(max_seq_len)
        raise EngineError(f"cannot tell the context length of {self.model_path}; set context_length for {self.model_id}")

    def _resolve_prompt_limit(self) -> int | None:
        """Without chunked prefill TensorRT-LLM refuses a prompt longer than max_num_tokens."""
        args = getattr(self._llm, "args", None)
        if getattr(args, "enable_chunked_prefill", False):
            return None
        value = getattr(args, "max_num_tokens", None) or self.max_num_tokens or DEFAULT_MAX_NUM_TOKENS
        return int(value)

    async def stop(self) -> None:
        self._ready = False
        if self._llm is not None:
            llm, self._llm = self._llm, None
            for live in list(self._live.values()):
                self._abort(live.result)
            await asyncio.to_thread(llm.shutdown)

    def _engine_died(self, exc: BaseException) -> EngineError:
        """The executor is gone: this engine stops taking requests (readiness, fallbacks and the
        router move on) and the request gets a 503."""
        if self._ready:
            log.error("TensorRT-LLM's executor for %s is gone (%s: %s); the model is marked not ready",
                      self.model_id, type(exc).__name__, exc)
        self._ready = False
        return EngineError(f"TensorRT-LLM's executor for {self.model_id} is not running ({type(exc).__name__}: {exc})")

    # tokenization -----------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
        """The messages (as the client sent them: content parts, tool calls, tool results) through the
        model's chat template, with the tools when there are any."""
        extra = {"tools": tools} if tools else {}
        encoded = self._tokenizer.apply_chat_template(chat_template_messages(messages), add_generation_prompt=True, tokenize=True, **extra)
        if not isinstance(encoded, list):
            encoded = encoded["input_ids"]
        return [int(t) for t in encoded]

    def encode_text(self, prompt: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(prompt, add_special_tokens=False)]

    # capacity ---------------------------------------------------------------------------------
    def has_capacity(self) -> bool:
        return self._ready and len(self._live) < self.capacity

    def slots(self) -> int | None:
        # Shared by several workers, the engine host's queue lets requests into the batch: this worker's
        # scheduler passes them on (its classes and reserve apply to the engine as a whole only there).
        if self.connect_to is not None:
            return None
        return self.max_batch_size  # the batch size TensorRT-LLM was built with (always passed)

    def requests_in_flight(self) -> int:
        return len(self._live)

    def cancel(self, request_id: str) -> None:
        """Aborts the request and ends its stream: at once when it has produced nothing yet (it may
        still be in TensorRT-LLM's queue, which drops it without an answer), else when TensorRT-LLM
        answers `cancelled` or after CANCEL_GRACE_S, whichever is first."""
        live = self._live.get(request_id)
        if live is None:
            return
        self._abort(live.result)
        if not live.seen_output:
            live.queue.put_nowait(_CANCELLED)
        elif live.timer is None:
            live.timer = asyncio.get_running_loop().call_later(CANCEL_GRACE_S, live.queue.put_nowait, _CANCELLED)

    def _saw_output(self) -> None:
        self._last_output = time.monotonic()

    async def _next(self, live: _Live) -> Any:
        """The next item of a request's queue. While it waits, other requests' outputs show the executor
        is alive; `output_timeout` seconds without any output from any request mean it is gone (a dead
        worker on TensorRT-LLM 1.0-1.2 answers nothing, not EngineDeadError): the engine turns not
        ready and every request it holds ends with the failure."""
        while True:
            if not live.queue.empty():
                return live.queue.get_nowait()
            try:
                async with asyncio.timeout(self.output_timeout):
                    return await live.queue.get()
            except TimeoutError:
                stalled = time.monotonic() - self._last_output
                if stalled < self.output_timeout:
                    continue  # the engine is busy with others: this one waits its turn
            failure = _Failure(ExecutorStalled(f"no output from TensorRT-LLM for any request in {stalled:.1f}s"))
            for other in self._live.values():
                if other is not live:
                    other.queue.put_nowait(failure)
            return failure

    @staticmethod
    def _abort(result: Any) -> None:
        try:
            if not result.finished:
                result.abort()
        except Exception as exc:  # noqa: BLE001 - an abort that fails must not fail the caller
            log.warning("TensorRT-LLM abort failed: %s: %s", type(exc).__name__, exc)

    # generation -------------------------------------------------------------------------------
    def _llmapi(self) -> Any:
        return getattr(self._api, "llmapi", None) or importlib.import_module("tensorrt_llm.llmapi")

    def check_fields(self, request: EngineRequest) -> None:
        """Refuses, as OpenAI-shaped 400s, the client's fields TensorRT-LLM's LLM API cannot honour
        (the gateway skips its own checks for this engine: `passthrough`)."""
        body = request.extra or {}
        if request.sequences > 1 and (body.get("tools") or self.logprobs_wanted(request) is not None):
            raise _rejected("n > 1 cannot be combined with tools or logprobs on this model", "n")
        if body.get("logit_bias"):
            raise _rejected("logit_bias is not supported by this model", "logit_bias")
        if body.get("echo"):
            raise _rejected("echo is not supported by this model", "echo")
        if body.get("suffix"):
            raise _rejected("suffix is not supported by this model", "suffix")
        top = body.get("top_logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise _rejected(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs", "invalid_value")
        if "messages" not in body and body.get("logprobs") is not None:
            lp = body["logprobs"]
            if not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= 5:
                raise _rejected("logprobs must be an integer from 0 to 5", "logprobs", "invalid_value")
        if body.get("tools"):
            if self.tool_parser is None:
                raise _rejected(f"tools are not supported by {self.model_id}: its models.yaml entry sets no tool_parser", "tools")
            choice = body.get("tool_choice")
            if choice not in (None, "auto", "none"):
                raise _rejected("tool_choice other than 'auto' or 'none' is not supported by this model", "tool_choice")
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
            if fmt.get("type") not in ("json_object", "json_schema"):
                raise _rejected(f"response_format type {fmt.get('type')!r} is not supported", "response_format", "invalid_value")
            spec = fmt.get("json_schema")
            if fmt.get("type") == "json_schema" and not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
                raise _rejected("response_format.json_schema.schema must be a JSON schema object", "response_format.json_schema", "invalid_value")
            if not getattr(getattr(self._llm, "args", None), "guided_decoding_backend", None):
                raise _rejected(
                    f"response_format needs guided decoding, which {self.model_id} was not started with "
                    "(set llm_options.guided_decoding_backend: xgrammar in models.yaml)", "response_format")

    @staticmethod
    def logprobs_wanted(request: EngineRequest) -> int | None:
        """SamplingParams.logprobs for the request: top-k alternatives per token (0: only the sampled
        token's), or None. Chat: logprobs=true with top_logprobs; text: logprobs=<k>."""
        body = request.extra or {}
        if "messages" in body:
            return int(body.get("top_logprobs") or 0) if body.get("logprobs") is True else None
        lp = body.get("logprobs")
        return int(lp) if isinstance(lp, int) and not isinstance(lp, bool) else None

    def sampling_params(self, request: EngineRequest) -> Any:
        s = request.sampling
        body = request.extra or {}
        kwargs: dict[str, Any] = {
            "max_tokens": request.max_tokens,  # TensorRT-LLM's default is 32: always set it
            "temperature": 0.0 if s.greedy else s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
            "stop": list(s.stop) or None,
            "include_stop_str_in_output": False,
        }
        if request.sequences > 1:  # n choices, from best_of sequences (TensorRT-LLM's default best_of is n)
            kwargs["n"] = request.n
            kwargs["best_of"] = request.sequences
        for name in ("presence_penalty", "frequency_penalty"):
            if body.get(name) is not None:
                kwargs[name] = float(body[name])
        logprobs = self.logprobs_wanted(request)
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
            llmapi = self._llmapi()
            if fmt["type"] == "json_object":
                kwargs["guided_decoding"] = llmapi.GuidedDecodingParams(json_object=True)
            else:
                kwargs["guided_decoding"] = llmapi.GuidedDecodingParams(json=fmt["json_schema"]["schema"])
        return self._api.SamplingParams(**kwargs)

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.messages is not None:
            return self.encode_chat(request.messages)
        return self.encode_text(request.prompt or "")

    @staticmethod
    def _prompt_param(request: EngineRequest) -> str:
        return "messages" if request.messages is not None or "messages" in (request.extra or {}) else "prompt"

    def _check_prompt(self, request: EngineRequest, prompt: list[int]) -> None:
        limit = self.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise EngineRequestRejected(
                f"The prompt has {len(prompt)} tokens; this model takes at most {limit} prompt tokens "
                f"(TensorRT-LLM's max_num_tokens, without chunked prefill).",
                param=self._prompt_param(request), code="context_length_exceeded",
            )

    def _refused(self, exc: BaseException, request: EngineRequest) -> EngineError:
        """What an exception from TensorRT-LLM before any output means for the client."""
        if engine_is_dead(exc):
            return self._engine_died(exc)
        if request_is_invalid(exc):
            return EngineRequestRejected(f"TensorRT-LLM rejected the request: {exc}", param=None, code="invalid_request")
        return EngineError(f"TensorRT-LLM refused the request: {type(exc).__name__}: {exc}")

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self._llm is None or not self._ready:
            raise EngineError("engine is not running")
        if not self.has_capacity():
            raise EngineOverloadedError("engine queue is full")
        rid = request.request_id
        self.check_fields(request)
        body = request.extra or {}
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        if body.get("tools") and isinstance(body.get("messages"), list):
            # The gateway reserved for the prompt with every tool (what a pass-through server may show);
            # this template shows them unless tool_choice is "none": rendered as it is prefilled.
            try:
                prompt = self.encode_chat(body["messages"], tools)
            except Exception as exc:
                raise _rejected(f"messages and tools could not be rendered with the model's chat template: {exc}", "tools", "invalid_value") from None
            room = self.context_length - len(prompt)
            if room < 1:
                raise _rejected(f"This model's maximum context length is {self.context_length} tokens; the prompt with its tools has {len(prompt)} tokens.",
                                "messages", "context_length_exceeded")
            if request.max_tokens > room:
                request = dataclasses.replace(request, max_tokens=room)
        else:
            prompt = self._prompt_ids(request)
        self._check_prompt(request, prompt)
        shape = _Shape.for_request(self, request, bool(tools))
        try:
            params = self.sampling_params(request)
            # The engine host's queue admits by account and class (a keyword only SharedLLM takes).
            shared = {"admission": (request.account_id, request.priority)} if self.connect_to is not None else {}
            result = self._llm.generate_async(prompt, sampling_params=params, streaming=True, **shared)
        except EngineError:
            raise
        except Exception as exc:
            raise self._refused(exc, request) from exc
        live = _Live(result)
        if not self._live:  # idle until now: the stall watch starts here
            self._last_output = time.monotonic()
        self._live[rid] = live
        if request.sequences > 1:
            live.pump = asyncio.get_running_loop().create_task(_pump(live, _many_sequences(live), self._saw_output))
            try:
                async with aclosing(self._stream_many(request, live, len(prompt))) as outputs:
                    async for out in outputs:
                        yield out
            finally:
                self._live.pop(rid, None)
                live.close()
                if not live.done:
                    self._abort(result)  # the consumer left early
            return
        live.pump = asyncio.get_running_loop().create_task(
            _pump(live, _one_sequence(live, want_logprobs=shape is not None and shape.logprobs), self._saw_output))
        stops = StopMatcher(request.sampling.stop)
        prompt_tokens, count, seen_ids = len(prompt), 0, 0
        cached: int | None = None
        finished = False
        try:
            while True:
                item = await self._next(live)
                if item is _CANCELLED:
                    finished = True
                    yield EngineOutput("", [], FINISH_CANCELLED, prompt_tokens, count, cached_tokens=cached)
                    return
                if isinstance(item, _Failure):
                    finished = True
                    raise self._failed(item.exc, request, seen_ids) from item.exc
                if item is _ENDED:
                    finished = True
                    raise EngineError("TensorRT-LLM ended the stream without a finished output")
                step: _Step = item
                prompt_tokens, count = step.prompt_tokens or prompt_tokens, step.count
                if step.cached_tokens is not None:
                    cached = step.cached_tokens
                seen_ids += len(step.token_ids)
                if step.finished:
                    finished = True
                    out = self._final(step, stops, result)
                    out.cached_tokens = cached
                    yield shape.shaped(out, step) if shape is not None else out
                    return
                text = stops.push(step.text)
                if stops.stopped:  # a stop string TensorRT-LLM did not catch: cut here, stop the executor
                    finished = True
                    self._abort(result)
                    out = EngineOutput(text, step.token_ids, FINISH_STOP, prompt_tokens, count, cached_tokens=cached)
                    yield shape.shaped(out, step) if shape is not None else out
                    return
                if text or step.token_ids:
                    out = EngineOutput(text, step.token_ids, None, prompt_tokens, count)
                    yield shape.shaped(out, step) if shape is not None else out
        finally:
            self._live.pop(rid, None)
            live.close()
            if not finished:
                self._abort(result)  # the consumer left early

    async def _stream_many(self, request: EngineRequest, live: _Live, prompt_tokens: int) -> AsyncIterator[EngineOutput]:
        """The outputs of a request with n > 1 choices. Streamed: each output carries one choice's
        chunk (`raw_choice`, with its `index`); several that changed in one response travel in the
        output's `before`. Not streamed: the final output carries every choice (`choices`). The
        counts are those of every sequence TensorRT-LLM generated (best_of of them): what it computed."""
        body = request.extra or {}
        chat, streamed = "messages" in body, body.get("stream") is True
        ranked = request.best_of > request.n  # best_of: the n best are known only at the end
        stops = request.sampling.stop
        choices = {i: _Choice(stops) for i in range(request.n)}
        total, cached, seen_ids = 0, None, 0
        while True:
            item = await self._next(live)
            if item is _CANCELLED:
                live.done = True
                yield EngineOutput("", [], FINISH_CANCELLED, prompt_tokens, total, cached_tokens=cached)
                return
            if isinstance(item, _Failure):
                live.done = True
                raise self._failed(item.exc, request, seen_ids) from item.exc
            if item is _ENDED:
                live.done = True
                raise EngineError("TensorRT-LLM ended the stream without a finished output")
            step: _Many = item
            prompt_tokens, total = step.prompt_tokens or prompt_tokens, step.total
            if step.cached_tokens is not None:
                cached = step.cached_tokens
            new_ids = [t for _, ids, _, _, _ in step.updates for t in ids]
            seen_ids += len(new_ids)
            if step.finished and step.error and not any(f for _, _, f, _ in step.final or ()):
                live.done = True
                raise EngineError(f"TensorRT-LLM failed the request: {step.error}")
            if step.finished and step.final and any(f == "cancelled" for _, _, f, _ in step.final):
                live.done = True
                yield EngineOutput("", [], FINISH_CANCELLED, prompt_tokens, total, cached_tokens=cached)
                return
            outs: list[EngineOutput] = []
            if not ranked:
                for index, ids, length, finish, stop_reason in step.updates:
                    choice = choices.get(index)
                    if choice is None or choice.finish is not None:
                        continue  # ended here on a stop string: the rest of its sequence is not shown
                    if length < len(choice.ids) + len(ids):  # the ids of a token-level stop were trimmed
                        choice.ids = (choice.ids + ids)[:length]
                        choice.prefix, choice.read = min(choice.prefix, length), min(choice.read, length)
                    else:
                        choice.ids += ids
                    text = choice.stops.push(choice.decode(self._tokenizer, flush=finish is not None))
                    reason = None
                    if choice.stops.stopped:
                        reason = FINISH_STOP
                    elif finish is not None:
                        reason = FINISH_REASONS.get(finish, FINISH_STOP)
                        if not isinstance(stop_reason, str):  # held-back text is a stop string's head only on a stop string
                            text += choice.stops.flush()
                    choice.finish = reason
                    outs.append(self._choice_output(chat, streamed, index, choice, text, reason, ids, prompt_tokens, total))
            ended = step.finished or (not ranked and all(c.finish is not None for c in choices.values()))
            if not ended:
                if streamed:
                    if outs:
                        last = outs.pop()
                        last.before = outs or None
                        yield last
                elif new_ids:
                    yield EngineOutput("", new_ids, None, prompt_tokens, total)
                continue
            live.done = True
            if ranked:  # the n best of best_of, as TensorRT-LLM ranks them at the end
                for index, ids, finish, stop_reason in step.final or ():
                    choice = choices[index]
                    choice.ids = ids
                    text = choice.stops.push(self._tokenizer.decode(ids, skip_special_tokens=True))
                    choice.finish = FINISH_STOP if choice.stops.stopped else FINISH_REASONS.get(finish or "", FINISH_STOP)
                    if not choice.stops.stopped and not isinstance(stop_reason, str):
                        text += choice.stops.flush()
                    choice.text.append(text)
            if not step.finished or any(c.finish is None for c in choices.values()):
                self._abort_after_finish(live.result)  # every choice ended here, or a text-level stop ended the result
            for index, choice in choices.items():
                if choice.finish is None:  # the result ended before this sequence did
                    choice.finish = FINISH_STOP
                    outs.append(self._choice_output(chat, streamed, index, choice, "", FINISH_STOP, [], prompt_tokens, total))
            overall = FINISH_LENGTH if any(c.finish == FINISH_LENGTH for c in choices.values()) else FINISH_STOP
            if streamed:
                last = outs.pop() if outs else self._choice_output(chat, True, request.n - 1, choices[request.n - 1], "", choices[request.n - 1].finish, [], prompt_tokens, total)
                last.before = outs or None
            else:
                last = EngineOutput("", new_ids, None, prompt_tokens, total)
                last.choices = [self._whole_choice(chat, i, c) for i, c in choices.items()]
            last.finish_reason, last.cached_tokens = overall, cached
            yield last
            return

    @staticmethod
    def _choice_output(chat: bool, streamed: bool, index: int, choice: _Choice, text: str, finish: str | None,
                       ids: list[int], prompt_tokens: int, total: int) -> EngineOutput:
        """An increment of one choice: its chunk when streamed, else kept for the final body."""
        out = EngineOutput("", ids, None, prompt_tokens, total)
        if not streamed:
            choice.text.append(text)
            return out
        if chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            if not choice.opened and index > 0:  # the gateway opened choice 0 with its role
                delta = {"role": "assistant", **delta}
            out.raw_choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            out.raw_choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        choice.opened = True
        return out

    @staticmethod
    def _whole_choice(chat: bool, index: int, choice: _Choice) -> dict[str, Any]:
        text = "".join(choice.text)
        if chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": choice.finish}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": choice.finish}

    def _failed(self, exc: BaseException, request: EngineRequest, seen_ids: int) -> EngineError:
        if isinstance(exc, EngineOverloadedError):  # the shared engine host's queue turned it away (a 429)
            return exc
        if engine_is_dead(exc):
            return self._engine_died(exc)
        if seen_ids == 0 and request_is_invalid(exc):
            return self._refused(exc, request)
        return EngineError(f"TensorRT-LLM failed the request: {type(exc).__name__}: {exc}")

    def _final(self, step: _Step, stops: StopMatcher, result: Any) -> EngineOutput:
        if step.finish_reason is None and step.error:
            raise EngineError(f"TensorRT-LLM failed the request: {step.error}")
        reason = FINISH_REASONS.get(step.finish_reason or "", FINISH_STOP)
        if reason == FINISH_CANCELLED:
            return EngineOutput("", step.token_ids, reason, step.prompt_tokens, step.count)
        early = FINISH_TIMEOUT if step.finish_reason == "timeout" else None  # the client sees `length`, the row `timeout`
        # The final increment: TensorRT-LLM has already cut a stop string it found in the text,
        # and trimmed the ids of one it matched on tokens (the text keeps what streamed before).
        text = stops.push(step.text)
        by_stop_string = stops.stopped or isinstance(step.stop_reason, str)
        # Which stop string ended it (Anthropic's stop_sequence): the one Tollgate found, else TensorRT-LLM's.
        matched = stops.matched or (step.stop_reason if isinstance(step.stop_reason, str) else None)
        if by_stop_string:
            reason = FINISH_STOP
            # Held-back text is the stop string's head: never flushed. A stop TensorRT-LLM found in
            # the text ends the result but not the executor's request, which generates on: that one is
            # aborted. Its stop on the ids ends the executor's request and trims them (the final response
            # then brings no ids); an end Tollgate found alone came with the executor's own end.
            if isinstance(step.stop_reason, str) and step.token_ids:
                self._abort_after_finish(result)
        else:
            text += stops.flush()
        return EngineOutput(text, step.token_ids, reason, step.prompt_tokens, step.count, recorded_finish=early,
                            stop_sequence=matched if by_stop_string else None)

    @staticmethod
    def _abort_after_finish(result: Any) -> None:
        try:
            result.abort()
        except Exception as exc:  # noqa: BLE001
            log.warning("TensorRT-LLM abort failed: %s: %s", type(exc).__name__, exc)
