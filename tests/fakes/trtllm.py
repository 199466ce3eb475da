"""A test double of TensorRT-LLM's LLM API (`tensorrt_llm` 1.x, PyTorch backend), for the `trtllm`
backend's tests.

TensorRT-LLM cannot be installed on these machines, so this module reproduces the surface the
backend uses and the behaviour it depends on, as read in NVIDIA's source at the commit stamped in
tests/contracts/trtllm_contract.json. tests/engines/backends/test_trtllm_contract.py proves the names,
signatures, fields and defaults here equal that contract's.

- `LLM(model, tokenizer=None, ..., tensor_parallel_size=1, dtype="auto", ..., **kwargs)`: the
  kwargs are validated as the real one does (against TorchLlmArgs' fields, read from the contract:
  the list the real one validates against); `.args` has the real defaults (max_batch_size 2048,
  max_num_tokens 8192, enable_chunked_prefill False, max_seq_len None); `.tokenizer`; `.shutdown()`.
- `generate_async(inputs, sampling_params=None, ..., streaming=False, ...)` (the real signature)
  returns a `RequestOutput` (GenerationResult) that is async-iterable, yields *itself* updated in
  place once per engine step, and is generated in the background whether or not anyone reads.
  It raises `RequestError` for a prompt over `max_num_tokens` without chunked prefill, and
  RuntimeError("LLM is shutting down") once the executor is gone.
- The executor runs `max_batch_size` requests at once; the rest wait in its queue. `abort()` of a
  running request ends it with a final `cancelled` output; `abort()` of a request still waiting is
  dropped without any output (as the real scheduler drops it), so its stream never ends by itself.
- Outputs: incremental detokenization (the text only grows; an end or stop token trimmed from the
  ids is not taken back from the text). Token-level stops (the stop strings' token ids, and
  `stop_token_ids`) finish with `stop` and trim the ids (not the text) unless
  `include_stop_str_in_output`; text-level stops (a stop string found in the text while
  generating) cut the text, finish the result with `stop`, and do not stop the executor.
- `SamplingParams.max_tokens` defaults to 32; `best_of` defaults to `n`; greedy with best_of > 1
  is refused; logprobs=True means 0; at most 100.
- Failures can be injected: `LLM.fail_next` is raised by the next `generate_async`;
  `llm.die()` puts `EngineDeadError` on every pending result (as the real proxy does when a
  worker dies) and shuts the executor; `llm.die(silently=True)` is a dead worker on 1.0-1.2
  (no EngineDeadError there): no result ever answers again.
- `cached_tokens` on the result: the prompt tokens served from the KV cache (`LLM.cached_prefix`
  of them, at most the prompt). `logprobs` on outputs: one {token: Logprob} per generated token,
  the top-k alternatives scripted.

- `n` / `best_of` as the real result does them (executor/result.py): the result holds `best_of`
  CompletionOutputs; the executor answers one sequence per response (`sequence_index`), so a
  response updates that sequence only (its `token_ids_diff`; the others keep their stale diffs, as
  the real `_handle_sequence` leaves them); the result is finished when every sequence is.
  `outputs` is the first `n` when n == best_of, else the `n` of highest `cumulative_logprob`,
  re-indexed. Sequence i generates the story from its i-th word (so the sequences differ), each
  token at logprob -0.25 * (i + 1).

It does not model GPU batching, KV-cache limits or beam search.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

EOS = "</s>"
STORY = " Once upon a time a lighthouse keeper watched the sea. The capital of France is Paris. The end."
CONTRACT = Path(__file__).resolve().parent.parent / "contracts" / "trtllm_contract.json"
MAX_TOP_LOGPROBS = 100
DEFAULT_REQUEST_PRIORITY = 0.5
# The TensorRT-LLM versions this double and the contract stand for: pyproject.toml's `trtllm` extra.
VERSIONS = ">=1.0,<1.4"


def contract() -> dict[str, Any]:
    return json.loads(CONTRACT.read_text())


class WordTokenizer:
    """Whitespace-attached word pieces: " Paris" and "Paris" are different tokens, as in BPE."""

    _pieces = re.compile(r"\s*[^\s]+|\s+")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {EOS: 0}
        self.words: list[str] = [EOS]
        self.eos_token_id = 0
        self.templates: list[dict[str, Any]] = []  # what apply_chat_template was given (tools included)

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.words)
            self.words.append(piece)
        return self.vocab[piece]

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        return [self._id(p) for p in self._pieces.findall(text)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        return "".join(self.words[t] for t in token_ids if not (skip_special_tokens and t == self.eos_token_id))

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs: Any) -> Any:
        self.templates.append({"conversation": conversation, "tools": tools})
        text = ""
        if tools:
            text += "<|tools|> " + " ".join(t.get("function", {}).get("name", "?") for t in tools) + " "
        for m in conversation:
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content)
            text += f"<|{m['role']}|> {content or ''} "
            for call in m.get("tool_calls") or ():
                text += f"<call> {call['function']['name']} {call['function']['arguments']} "
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text


# errors ----------------------------------------------------------------------------------------------
class RequestError(RuntimeError):
    """The error raised when the request is failed (tensorrt_llm.executor.utils)."""


class EngineDeadError(RuntimeError):
    """What the real proxy puts on every pending result when an executor worker dies."""


# llm_args ---------------------------------------------------------------------------------------------
class CapacitySchedulerPolicy(str, enum.Enum):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


class ContextChunkingPolicy(str, enum.Enum):
    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
    EQUAL_PROGRESS = "EQUAL_PROGRESS"
    FORCE_CHUNK = "FORCE_CHUNK"


class WaitingQueuePolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(kw_only=True)
class SchedulerConfig:
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    context_chunking_policy: Optional[ContextChunkingPolicy] = None
    dynamic_batch_config: Optional[Any] = None
    waiting_queue_policy: WaitingQueuePolicy = WaitingQueuePolicy.FCFS
    use_python_scheduler: bool = False
    enable_prefix_aware_scheduling: bool = True


@dataclass(kw_only=True)
class KvCacheConfig:
    enable_block_reuse: bool = True
    max_tokens: Optional[int] = None
    max_attention_window: Optional[list[int]] = None
    sink_token_length: Optional[int] = None
    free_gpu_memory_fraction: Optional[float] = 0.9
    host_cache_size: Optional[int] = None
    disk_cache_size: Optional[int] = None
    disk_cache_path: Optional[str] = None
    cross_kv_cache_fraction: Optional[float] = None
    secondary_offload_min_priority: Optional[int] = None
    event_buffer_max_size: int = 0
    attention_dp_events_gather_period_ms: int = 5
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    use_uvm: bool = False
    max_gpu_total_bytes: int = 0
    iteration_stats_interval: int = 1
    dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_ssm_stochastic_rounding: bool = False
    mamba_ssm_philox_rounds: int = 10
    tokens_per_block: int = 32
    mamba_state_cache_interval: Optional[int] = None
    mamba_state_config: Any = field(default_factory=dict)  # MambaStateConfig in the real one
    use_kv_cache_manager_v2: Union[bool, str] = "auto"
    enable_swa_scratch_reuse: bool = False
    kv_cache_event_hash_algo: str = "auto"
    max_util_for_resume: float = 0.95
    enable_kv_pool_rebalance: bool = False
    disk_prefetch_num_reqs: int = 0
    fp8_context_mla_kv_len_cap: Optional[int] = None
    pool_ratio: Optional[list[float]] = None
    avg_seq_len: Optional[int] = None
    block_reuse_config: Any = field(default_factory=dict)  # BlockReuseConfig in the real one

    def __post_init__(self) -> None:
        if self.free_gpu_memory_fraction is not None and not 0 <= self.free_gpu_memory_fraction <= 1:
            raise ValueError("kv_cache_config.free_gpu_memory_fraction must be a float between 0 and 1")


# sampling ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class GuidedDecodingParams:
    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[str] = None

    def _validate(self) -> None:
        guides = sum(bool(getattr(self, f)) for f in ("json", "regex", "grammar", "json_object", "structural_tag"))
        if guides > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {guides}.")


class LogprobMode(str, enum.Enum):
    RAW = "raw"
    PROCESSED = "processed"


@dataclass(kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    bad: Optional[Union[str, list[str]]] = None
    bad_token_ids: Optional[list[int]] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    embedding_bias: Optional[Any] = None
    logits_processor: Optional[Any] = None
    apply_batched_logits_processor: bool = False
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    logprobs_mode: LogprobMode = LogprobMode.RAW
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    top_p_min: Optional[float] = None
    top_p_reset_ids: Optional[int] = None
    top_p_decay: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    min_tokens: Optional[int] = None
    beam_search_diversity_rate: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    prompt_ignore_length: Optional[int] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[int] = None
    no_repeat_ngram_size: Optional[int] = None
    min_p: Optional[float] = None
    beam_width_array: Optional[list[int]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logprobs_simple_format: bool = False
    prompt_logprobs_simple_format: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: Optional[list[str]] = None
    lookahead_config: Optional[Any] = None
    guided_decoding: Optional[GuidedDecodingParams] = None
    thinking_token_budget: Optional[int] = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and not self.temperature >= 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        if self.best_of > 1 and self._greedy_decoding and not os.environ.get("TLLM_ALLOW_N_GREEDY_DECODING"):
            raise ValueError(f"Greedy decoding in the LLM API does not allow multiple returns. Please set to best_of=1, got best_of={self.best_of}.")
        if self.guided_decoding is not None:
            self.guided_decoding._validate()
        if self.logprobs is False:
            self.logprobs = None
        if self.logprobs is True:
            self.logprobs = 0
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be positive, zero or None and at most {MAX_TOP_LOGPROBS}")

    @property
    def _greedy_decoding(self) -> bool:
        if self.use_beam_search:
            return False
        if self.top_k == 1 or self.top_p == 0.0 or self.min_p == 1.0 or self.temperature == 0:
            return True
        return self.temperature is None and self.top_p is None and self.top_k is None and not (self.min_p or 0) > 0

    def _stop_reasons_and_words(self, tokenizer: WordTokenizer) -> list[tuple[Union[str, int], list[int]]]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        words: list[tuple[Union[str, int], list[int]]] = [(t, [t]) for t in self.stop_token_ids or []]
        return words + [(s, tokenizer.encode(s, add_special_tokens=False)) for s in stops]


# results ----------------------------------------------------------------------------------------------
@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: Optional[list[int]] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[Any]] = field(default_factory=list)
    prompt_logprobs: Optional[list[Any]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    generation_logits: Optional[Any] = None
    additional_context_outputs: Optional[dict[str, Any]] = None
    additional_generation_outputs: Optional[dict[str, Any]] = None
    disaggregated_params: Optional[Any] = None
    request_perf_metrics: Optional[Any] = None
    _last_text_len: int = field(default=0, init=False, repr=False)
    _last_token_ids_len: int = field(default=0, init=False, repr=False)
    _last_logprobs_len: int = field(default=0, init=False, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]

    @property
    def logprobs_diff(self) -> list[Any]:
        return self.logprobs[self._last_logprobs_len :]


@dataclass
class _Step:
    """One executor response: the tokens of one step and, on the last, why it ended."""

    token_ids: list[int]
    finish: Optional[str] = None  # end_id | stop_words | length | timeout | cancelled
    logprobs: Optional[list[dict[int, Logprob]]] = None
    index: int = 0  # sequence_index: the sequence this response is for
    final: Optional[bool] = None  # is_final: the whole request is done (None: when `finish` is set)
    cum_logprob: Optional[float] = None  # the sequence's cumulative logprob so far


class RequestOutput:
    """What `generate_async` returns (TensorRT-LLM's RequestOutput, a GenerationResult)."""

    def __init__(self, llm: "LLM", request_id: int, prompt_token_ids: list[int], params: SamplingParams, streaming: bool) -> None:
        self.id = request_id
        self._prompt_token_ids = prompt_token_ids
        self.sampling_params = params
        self.cached_tokens = 0
        self._outputs = [CompletionOutput(i) for i in range(params.best_of)]
        self._llm = llm
        self._streaming = streaming
        self._done = False
        self._aborted = False
        self._terminal_error: Optional[BaseException] = None
        self._responses: asyncio.Queue[Any] = asyncio.Queue()
        self._abort_event = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(llm._generate(self))

    @property
    def request_id(self) -> int:
        return self.id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    @property
    def outputs(self) -> list[CompletionOutput]:
        params = self.sampling_params
        if params.use_beam_search or params.n == params.best_of:
            return self._outputs[: params.n]
        ranked = sorted(self._outputs, key=lambda o: o.cumulative_logprob if o.cumulative_logprob is not None else float("-inf"), reverse=True)
        for i, out in enumerate(ranked):  # re-indexed, as the real property does
            out.index = i
        return ranked[: params.n]

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._aborted = True
        self._abort_event.set()
        self._llm.aborts.append(self.request_id)

    def aborted(self) -> bool:
        return self._aborted

    def __aiter__(self) -> "RequestOutput":
        return self

    async def __anext__(self) -> "RequestOutput":
        if self._terminal_error is not None:
            raise self._terminal_error
        if self._done:
            raise StopAsyncIteration
        await self._step()
        return self

    async def aresult(self) -> "RequestOutput":
        if self._terminal_error is not None:
            raise self._terminal_error
        while not self._done:
            await self._step()
        return self

    async def _step(self) -> None:
        response = await self._responses.get()
        if isinstance(response, EngineDeadError):
            self._terminal_error = response
            self._done = True
            raise response
        self._handle(response)

    def _handle(self, step: _Step) -> None:
        params, tokenizer, out = self.sampling_params, self._llm.tokenizer, self._outputs[step.index]
        self.cached_tokens = min(self._llm.cached_prefix, len(self._prompt_token_ids))
        out._last_token_ids_len = len(out.token_ids)
        out._last_logprobs_len = len(out.logprobs)
        out.token_ids.extend(step.token_ids)
        if step.cum_logprob is not None:
            out.cumulative_logprob = step.cum_logprob
        if step.logprobs:
            out.logprobs.extend(step.logprobs)
        if step.final if step.final is not None else step.finish is not None:
            self._done = True
        if step.finish is not None:
            if step.finish == "stop_words":
                out.finish_reason = "stop"
                for reason, ids in params._stop_reasons_and_words(tokenizer):
                    if ids and out.token_ids[-len(ids):] == ids:
                        out.stop_reason = reason
                        if not params.include_stop_str_in_output:
                            out.token_ids = out.token_ids[: -len(ids)]
                        break
            else:
                out.finish_reason = {"end_id": "stop", "length": "length", "timeout": "timeout", "cancelled": "cancelled"}[step.finish]
        if not params.detokenize:
            return
        for other in self.outputs:  # the real loop runs over every visible output: no text diff for the others
            other._last_text_len = len(other.text)
        # Incremental detokenization: the ids of this step (after any trimming) extend the text.
        out.text += tokenizer.decode(out.token_ids_diff, skip_special_tokens=params.skip_special_tokens)
        if not self._done or out.finish_reason in ("stop", "length"):
            stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
            for stop in stops:
                if stop in out.text:  # text-level stop: the text is cut, the result ends here
                    pos = out.text.find(stop)
                    out.text = out.text[: pos + len(stop)] if params.include_stop_str_in_output else out.text[:pos]
                    out.finish_reason, out.stop_reason = "stop", stop
                    self._done = True
                    break


@dataclass
class Args:
    """`llm.args`: the settings the LLM was built with, the rest at TorchLlmArgs' defaults."""

    values: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None


def _llm_args_defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in contract()["classes"]["TorchLlmArgs"]["fields"]:
        if "default" in f:
            out[f["name"]] = f["default"]
        elif "default_factory" in f:
            out[f["name"]] = {"KvCacheConfig": KvCacheConfig, "SchedulerConfig": SchedulerConfig}.get(f["default_factory"], dict)()
        else:
            out[f["name"]] = None
    return out


class LLM:
    """The double's engine: it 'generates' `continuation` one token per step."""

    instances: list["LLM"] = []
    continuation = STORY
    step_delay = 0.002  # seconds per engine step
    timeout_after: Optional[int] = None  # end requests with finish_reason "timeout" after this many steps
    fail_next: Optional[BaseException] = None  # raised by the next generate_async
    cached_prefix = 0  # prompt tokens found in the KV cache (reported as cached_tokens)
    top_alternatives: list[tuple[str, float]] = [(" maybe", -2.5), (" perhaps", -3.0)]  # scripted top-k logprobs

    def __init__(
        self,
        model: Union[str, Path],
        tokenizer: Optional[Any] = None,
        tokenizer_mode: str = "auto",
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        revision: Optional[str] = None,
        tokenizer_revision: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        fields = {f["name"] for f in contract()["classes"]["TorchLlmArgs"]["fields"]}
        unsupported = [k for k in kwargs if k not in fields and k not in ("_mpi_session", "backend")]
        if unsupported:
            raise ValueError(f"The following arguments are not supported by the PyTorch backend: {unsupported}.")
        values = _llm_args_defaults()
        values.update(model=model, tokenizer=tokenizer, tokenizer_mode=tokenizer_mode, skip_tokenizer_init=skip_tokenizer_init,
                      trust_remote_code=trust_remote_code, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                      revision=revision, tokenizer_revision=tokenizer_revision, **kwargs)
        for name in ("max_batch_size", "max_input_len", "max_beam_width", "max_num_tokens"):  # None means the default
            if values[name] is None:
                values[name] = _llm_args_defaults()[name]
        self.args = Args(values)
        self.explicit_kwargs = dict(kwargs)
        self.tokenizer = WordTokenizer()
        self.requests: list[RequestOutput] = []
        self.aborts: list[int] = []
        self.running = 0  # requests the executor is generating
        self.waiting: list[RequestOutput] = []  # requests in the executor's queue
        self.dropped: list[int] = []  # aborted while waiting: dropped without an output
        self.shut_down = False
        self.hold = asyncio.Event()  # cleared: running requests do not step (a test holds the batch full)
        self.hold.set()
        self._slots = asyncio.Semaphore(self.args.max_batch_size)
        self._next_id = 0
        LLM.instances.append(self)

    def generate_async(
        self,
        inputs: Any,
        sampling_params: Optional[SamplingParams] = None,
        lora_request: Optional[Any] = None,
        prompt_adapter_request: Optional[Any] = None,
        streaming: bool = False,
        kv_cache_retention_config: Optional[Any] = None,
        disaggregated_params: Optional[Any] = None,
        trace_headers: Optional[Any] = None,
        _postproc_params: Optional[Any] = None,
        scheduling_params: Optional[Any] = None,
        conversation_params: Optional[Any] = None,
        cache_salt: Optional[str] = None,
        priority: float = DEFAULT_REQUEST_PRIORITY,
    ) -> RequestOutput:
        if self.shut_down:
            raise RuntimeError("LLM is shutting down")
        if LLM.fail_next is not None:
            exc, LLM.fail_next = LLM.fail_next, None
            raise exc
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"The sampling_params must be type SamplingParams or None, but got {type(params)}")
        if isinstance(inputs, str):
            prompt_ids = self.tokenizer.encode(inputs)
        elif isinstance(inputs, list) and all(isinstance(t, int) for t in inputs):
            prompt_ids = list(inputs)
        else:
            raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")
        if not self.args.enable_chunked_prefill and self.args.max_num_tokens and len(prompt_ids) > self.args.max_num_tokens:
            raise RequestError(f"The sum of prompt length ({float(len(prompt_ids))}), query length (0) should not exceed max_num_tokens ({self.args.max_num_tokens})")
        self._next_id += 1
        result = RequestOutput(self, self._next_id, prompt_ids, params, streaming)
        self.requests.append(result)
        return result

    async def _admitted(self, result: RequestOutput) -> bool:
        """Waits in the executor's queue for a slot; False: aborted while waiting (dropped, no output)."""
        self.waiting.append(result)
        acquire = asyncio.ensure_future(self._slots.acquire())
        aborted = asyncio.ensure_future(result._abort_event.wait())
        try:
            await asyncio.wait({acquire, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.waiting.remove(result)
            aborted.cancel()
        if acquire.done() and not acquire.cancelled() and not result._aborted:
            return True
        if acquire.done() and not acquire.cancelled():
            self._slots.release()
        else:
            acquire.cancel()
        self.dropped.append(result.request_id)
        return False

    async def _generate(self, result: RequestOutput) -> None:
        if not await self._admitted(result):
            return
        params = result.sampling_params
        if params.best_of > 1:
            await self._generate_many(result)
            return
        plan = self.tokenizer.encode(self.continuation) + [self.tokenizer.eos_token_id]
        stops = [ids for _, ids in params._stop_reasons_and_words(self.tokenizer) if ids]
        end_id = params.end_id if params.end_id is not None else self.tokenizer.eos_token_id
        generated: list[int] = []
        self.running += 1
        try:
            for step in range(len(plan) + params.max_tokens):
                await asyncio.sleep(self.step_delay)
                await self.hold.wait()
                if result._aborted:
                    result._responses.put_nowait(_Step([], "cancelled"))
                    return
                if self.timeout_after is not None and step >= self.timeout_after:
                    result._responses.put_nowait(_Step([], "timeout"))
                    return
                token = plan[step % len(plan)] if not params.ignore_eos else plan[step % (len(plan) - 1)]
                generated.append(token)
                finish = None
                if token == end_id and not params.ignore_eos:
                    finish = "end_id"
                elif any(generated[-len(s):] == s for s in stops):
                    finish = "stop_words"
                elif len(generated) >= params.max_tokens:
                    finish = "length"
                result._responses.put_nowait(_Step([token], finish, self._logprobs(token, params)))
                if finish:
                    return
        finally:
            self.running -= 1
            self._slots.release()

    async def _generate_many(self, result: RequestOutput) -> None:
        """best_of sequences of one request, stepped together: per engine step one response per
        sequence still running (its `sequence_index`), `is_final` on the last response of the request."""
        params = result.sampling_params
        words = self.tokenizer.encode(self.continuation)
        plans = [words[i % len(words):] + [self.tokenizer.eos_token_id] for i in range(params.best_of)]
        stops = [ids for _, ids in params._stop_reasons_and_words(self.tokenizer) if ids]
        end_id = params.end_id if params.end_id is not None else self.tokenizer.eos_token_id
        generated: list[list[int]] = [[] for _ in plans]
        running = list(range(len(plans)))
        self.running += 1
        try:
            for step in range(max(len(p) for p in plans) + params.max_tokens):
                await asyncio.sleep(self.step_delay)
                await self.hold.wait()
                if result._aborted or (self.timeout_after is not None and step >= self.timeout_after):
                    why = "cancelled" if result._aborted else "timeout"
                    for k, i in enumerate(running):
                        result._responses.put_nowait(_Step([], why, index=i, final=k == len(running) - 1))
                    return
                for i in list(running):
                    plan = plans[i]
                    token = plan[step % len(plan)] if not params.ignore_eos else plan[step % max(1, len(plan) - 1)]
                    generated[i].append(token)
                    finish = None
                    if token == end_id and not params.ignore_eos:
                        finish = "end_id"
                    elif any(generated[i][-len(s):] == s for s in stops):
                        finish = "stop_words"
                    elif len(generated[i]) >= params.max_tokens:
                        finish = "length"
                    if finish:
                        running.remove(i)
                    result._responses.put_nowait(_Step([token], finish, self._logprobs(token, params), index=i, final=not running,
                                                       cum_logprob=-0.25 * (i + 1) * len(generated[i])))
                if not running:
                    return
        finally:
            self.running -= 1
            self._slots.release()

    def _logprobs(self, token: int, params: SamplingParams) -> Optional[list[dict[int, Logprob]]]:
        if params.logprobs is None:
            return None
        entry = {token: Logprob(-0.25, 1)}
        for rank, (piece, lp) in enumerate(self.top_alternatives[: params.logprobs], start=2):
            entry.setdefault(self.tokenizer._id(piece), Logprob(lp, rank))
        return [entry]

    def die(self, message: str = "Executor worker died", *, silently: bool = False) -> None:
        """The executor's worker died: every pending result gets EngineDeadError, new requests are refused.
        `silently`: as on TensorRT-LLM 1.0-1.2, which has no EngineDeadError: nothing reaches any result
        again (running requests stop stepping), and new requests are taken and never answered."""
        if silently:
            self.hold.clear()
            return
        self.shut_down = True
        for result in self.requests:
            if not result.finished:  # thread-safe: a test may call this from outside the server's loop
                result._task.get_loop().call_soon_threadsafe(result._responses.put_nowait, EngineDeadError(message))

    def shutdown(self) -> None:
        self.shut_down = True


def modules() -> tuple[types.ModuleType, types.ModuleType]:
    """The double as the `tensorrt_llm` and `tensorrt_llm.llmapi` modules, exporting what the real
    ones export of these names (the top level binds LLM and SamplingParams, not the configs)."""
    top = types.ModuleType("tensorrt_llm")
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    for name, value in {"LLM": LLM, "SamplingParams": SamplingParams}.items():
        setattr(top, name, value)
    for name, value in {
        "LLM": LLM, "SamplingParams": SamplingParams, "GuidedDecodingParams": GuidedDecodingParams,
        "CompletionOutput": CompletionOutput, "RequestOutput": RequestOutput, "KvCacheConfig": KvCacheConfig,
        "SchedulerConfig": SchedulerConfig, "CapacitySchedulerPolicy": CapacitySchedulerPolicy,
        "ContextChunkingPolicy": ContextChunkingPolicy, "RequestError": RequestError,
    }.items():
        setattr(llmapi, name, value)
    top.llmapi = llmapi  # type: ignore[attr-defined]
    return top, llmapi


def install(monkeypatch: Any) -> types.ModuleType:
    """Makes `import tensorrt_llm` find the double for one test."""
    top, llmapi = modules()
    monkeypatch.setitem(sys.modules, "tensorrt_llm", top)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    for cls in (LLM,):  # class-level knobs a test may have set
        monkeypatch.setattr(cls, "fail_next", None)
    return top
