"""`trtllm` backend: TensorRT-LLM's LLM API in this process (its PyTorch backend, 1.x).

    LLM(model=<HF checkpoint dir>, tensor_parallel_size, max_batch_size, max_num_tokens,
        kv_cache_config=KvCacheConfig(free_gpu_memory_fraction), scheduler_config=...)
    async for out in llm.generate_async(prompt_ids, sampling_params, streaming=True):
        out.outputs[0].text_diff / token_ids_diff   the increment
        out.prompt_token_ids / outputs[0].token_ids  the counts
        outputs[0].finish_reason                     stop | length | timeout | cancelled
    out.abort()                                      on client disconnect

TensorRT-LLM does the in-flight batching; this module only maps requests and outputs. The
package is an optional extra (`tollgate[trtllm]`) imported lazily: without it, selecting this
backend fails at start-up with one message (`require_tensorrt_llm`).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from engines.base import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    EngineError,
    EngineOutput,
    EngineOverloadedError,
    EngineRequest,
)
from engines.text import StopMatcher

log = logging.getLogger("tollgate.engines.trtllm")

MISSING = (
    "the trtllm backend needs TensorRT-LLM (the `tensorrt_llm` package), which is not installed here. "
    "Install it on a CUDA machine with `pip install 'tollgate[trtllm]'` (the wheel comes from NVIDIA's "
    "package index), or serve the model with trtllm-serve and use the `openai` backend."
)
# TensorRT-LLM's finish reasons in OpenAI's terms. `timeout` ends a request early, as `length` does.
FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "timeout": FINISH_LENGTH, "cancelled": FINISH_CANCELLED}
SCHEDULER_POLICIES = {"guaranteed_no_evict": "GUARANTEED_NO_EVICT", "max_utilization": "MAX_UTILIZATION"}


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


class TRTLLMEngine(Engine):
    owned_by = "tollgate-trtllm"

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
        api: Any = None,
    ) -> None:
        """`api` is the `tensorrt_llm` module; None imports it at start. `llm_options` go to
        `LLM(...)` as they are (e.g. cuda_graph_config), after the settings named here."""
        if scheduler_policy is not None and scheduler_policy not in SCHEDULER_POLICIES:
            raise ValueError(f"scheduler_policy must be one of {', '.join(SCHEDULER_POLICIES)}")
        self.model_id = model_id
        self.model_path = model_path
        self.context_length = context_length or 0
        self._configured_context = context_length
        self.tensor_parallel_size = tensor_parallel_size
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.kv_cache_free_gpu_memory_fraction = kv_cache_free_gpu_memory_fraction
        self.scheduler_policy = scheduler_policy
        self.llm_options = dict(llm_options or {})
        self.capacity = (max_batch_size or 256) + max_queue
        self._api = api
        self._llm: Any = None
        self._tokenizer: Any = None
        self._live: dict[str, Any] = {}  # request id -> TensorRT-LLM's result object (for abort)
        self._ready = False

    # lifecycle --------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready

    def llm_kwargs(self, api: Any) -> dict[str, Any]:
        """The keyword arguments for `tensorrt_llm.LLM`, from this engine's settings."""
        llmapi = getattr(api, "llmapi", None) or importlib.import_module("tensorrt_llm.llmapi")
        kwargs: dict[str, Any] = {"model": self.model_path, "tensor_parallel_size": self.tensor_parallel_size}
        if self.max_batch_size is not None:
            kwargs["max_batch_size"] = self.max_batch_size
        if self.max_num_tokens is not None:
            kwargs["max_num_tokens"] = self.max_num_tokens
        if self._configured_context is not None:
            kwargs["max_seq_len"] = self._configured_context
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
        api = self._api if self._api is not None else import_tensorrt_llm()
        self._api = api
        # Building the executor loads weights and captures CUDA graphs: minutes, off the loop.
        self._llm = await asyncio.to_thread(lambda: api.LLM(**self.llm_kwargs(api)))
        self._tokenizer = self._llm.tokenizer
        self.context_length = self._resolve_context_length()
        self._ready = True
        log.info("model %s ready on TensorRT-LLM in %.1fs", self.model_id, time.perf_counter() - started)

    def _resolve_context_length(self) -> int:
        if self._configured_context:
            return self._configured_context
        max_seq_len = getattr(getattr(self._llm, "args", None), "max_seq_len", None)
        if max_seq_len:
            return int(max_seq_len)
        config = Path(self.model_path) / "config.json"
        if config.exists():
            value = json.loads(config.read_text()).get("max_position_embeddings")
            if value:
                return int(value)
        raise EngineError(f"cannot tell the context length of {self.model_path}; set context_length for {self.model_id}")

    async def stop(self) -> None:
        self._ready = False
        if self._llm is not None:
            llm, self._llm = self._llm, None
            for result in list(self._live.values()):
                result.abort()
            await asyncio.to_thread(llm.shutdown)

    # tokenization -----------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        encoded = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(encoded, list):
            encoded = encoded["input_ids"]
        return [int(t) for t in encoded]

    def encode_text(self, prompt: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(prompt, add_special_tokens=False)]

    # capacity ---------------------------------------------------------------------------------
    def has_capacity(self) -> bool:
        return self._ready and len(self._live) < self.capacity

    def slots(self) -> int | None:
        return self.max_batch_size or 256  # 256: what `capacity` assumes when the batch size is left to TensorRT-LLM

    def requests_in_flight(self) -> int:
        return len(self._live)

    def cancel(self, request_id: str) -> None:
        """Aborts the request; TensorRT-LLM then ends its stream with `cancelled`."""
        result = self._live.get(request_id)
        if result is not None and not result.finished:
            result.abort()

    # generation -------------------------------------------------------------------------------
    def sampling_params(self, request: EngineRequest) -> Any:
        s = request.sampling
        return self._api.SamplingParams(
            max_tokens=request.max_tokens,  # TensorRT-LLM's default is 32: always set it
            temperature=0.0 if s.greedy else s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop=list(s.stop) or None,
            include_stop_str_in_output=False,
        )

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.messages is not None:
            return self.encode_chat(request.messages)
        return self.encode_text(request.prompt or "")

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self._llm is None:
            raise EngineError("engine is not running")
        if not self.has_capacity():
            raise EngineOverloadedError("engine queue is full")
        rid = request.request_id
        try:
            result = self._llm.generate_async(self._prompt_ids(request), sampling_params=self.sampling_params(request), streaming=True)
        except Exception as exc:
            raise EngineError(f"TensorRT-LLM refused the request: {exc}") from exc
        self._live[rid] = result
        stops = StopMatcher(request.sampling.stop)
        emitted = ""  # text handed out so far
        finished = False
        try:
            # TensorRT-LLM yields the same result object each step, updated in place.
            async for out in result:
                completion = out.outputs[0]
                prompt_tokens = len(out.prompt_token_ids)
                if out.finished:
                    finished = True
                    yield self._final(completion, emitted, request, prompt_tokens)
                    return
                ids = list(completion.token_ids_diff)
                text = stops.push(completion.text_diff)
                emitted += text
                if stops.stopped:  # a stop string TensorRT-LLM's token matching did not catch
                    finished = True
                    result.abort()
                    yield EngineOutput(text, ids, FINISH_STOP, prompt_tokens, len(completion.token_ids))
                    return
                if text or ids:
                    yield EngineOutput(text, ids, None, prompt_tokens, len(completion.token_ids))
        except Exception as exc:
            finished = True
            raise EngineError(f"TensorRT-LLM failed the request: {exc}") from exc
        finally:
            self._live.pop(rid, None)
            if not finished and not result.finished:
                result.abort()  # the consumer left early
        raise EngineError("TensorRT-LLM ended the stream without a finished output")

    def _final(self, completion: Any, emitted: str, request: EngineRequest, prompt_tokens: int) -> EngineOutput:
        reason = FINISH_REASONS.get(completion.finish_reason or "", FINISH_STOP)
        ids = list(completion.token_ids_diff)
        count = len(completion.token_ids)  # stop tokens already trimmed by TensorRT-LLM
        if reason == FINISH_CANCELLED:
            return EngineOutput("", ids, reason, prompt_tokens, count)
        # The final text may be shorter than what streamed (a trimmed stop string): only what
        # extends the text already sent goes out, cut at a stop string if one is in it.
        full = completion.text
        tail = full[len(emitted):] if full.startswith(emitted) else ""
        stops = StopMatcher(request.sampling.stop)
        text = stops.push(tail)
        if stops.stopped:
            reason = FINISH_STOP
        else:
            text += stops.flush()
        return EngineOutput(text, ids, reason, prompt_tokens, count)
