"""A test double of TensorRT-LLM's LLM API (`tensorrt_llm` 1.x), for the `trtllm` backend's tests.

TensorRT-LLM cannot be installed on these machines (see ../shared/docs/REFERENCE.md), so this
module reproduces the documented surface the backend uses, and its behaviour:

- `LLM(model=..., tensor_parallel_size=, max_batch_size=, max_num_tokens=, max_seq_len=,
  kv_cache_config=KvCacheConfig(...), scheduler_config=SchedulerConfig(...), **kwargs)`, with
  `.tokenizer` (encode / decode / apply_chat_template / eos_token_id), `.args`, `.shutdown()`.
- `generate_async(inputs, sampling_params, streaming=True)` returns one result object that is
  async-iterable and yields *itself*, updated in place, once per engine step (as
  `GenerationResult.__anext__` does). Generation runs in the background whether or not
  anyone reads, like the real executor.
- `outputs[0]`: cumulative `text` and `token_ids`; `text_diff` / `token_ids_diff` are the part
  added by the latest step; `prompt_token_ids` on the result.
- `finish_reason`: `stop` (end id or a stop word), `length` (max_tokens), `timeout`, and
  `cancelled` after `abort()`.
- `SamplingParams.max_tokens` defaults to 32. Stop strings are matched on token ids (a stop
  string tokenized differently in the output is not caught, as in TensorRT-LLM); with
  `include_stop_str_in_output=False` the stop tokens are trimmed from `token_ids` (and the text)
  in the final output only, so earlier streamed steps may already have carried them.

It does not model GPU batching, KV-cache limits, logprobs, beam search or n > 1.
"""

from __future__ import annotations

import asyncio
import enum
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any

EOS = "</s>"
STORY = " Once upon a time a lighthouse keeper watched the sea. The capital of France is Paris. The end."


class WordTokenizer:
    """Whitespace-attached word pieces: " Paris" and "Paris" are different tokens, as in BPE."""

    _pieces = re.compile(r"\s*[^\s]+|\s+")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {EOS: 0}
        self.words: list[str] = [EOS]
        self.eos_token_id = 0

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.words)
            self.words.append(piece)
        return self.vocab[piece]

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        return [self._id(p) for p in self._pieces.findall(text)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        return "".join(self.words[t] for t in token_ids if not (skip_special_tokens and t == self.eos_token_id))

    def apply_chat_template(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = False, tokenize: bool = True, **kwargs: Any) -> Any:
        text = "".join(f"<|{m['role']}|> {m['content']} " for m in conversation)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text


class CapacitySchedulerPolicy(enum.Enum):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


@dataclass
class KvCacheConfig:
    free_gpu_memory_fraction: float | None = None
    enable_block_reuse: bool = True
    max_tokens: int | None = None


@dataclass
class SchedulerConfig:
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT


@dataclass(kw_only=True)
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True

    def _stop_words(self, tokenizer: WordTokenizer) -> list[list[int]]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [tokenizer.encode(s, add_special_tokens=False) for s in stops]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    _last_text_len: int = 0
    _last_token_ids_len: int = 0

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]


@dataclass
class _Step:
    """One executor response: the tokens of one step and, on the last, why it ended."""

    token_ids: list[int]
    finish: str | None = None  # end_id | stop_words | length | timeout | cancelled


class RequestOutput:
    """What `generate_async` returns (TensorRT-LLM's GenerationResult)."""

    def __init__(self, llm: "LLM", request_id: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = params
        self.outputs = [CompletionOutput(0)]
        self._llm = llm
        self._done = False
        self._aborted = False
        self._responses: asyncio.Queue[_Step] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(llm._generate(self))

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._aborted = True
        self._llm.aborts.append(self.request_id)

    def aborted(self) -> bool:
        return self._aborted

    def __aiter__(self) -> "RequestOutput":
        return self

    async def __anext__(self) -> "RequestOutput":
        if self._done:
            raise StopAsyncIteration
        self._handle(await self._responses.get())
        return self

    async def aresult(self) -> "RequestOutput":
        while not self._done:
            self._handle(await self._responses.get())
        return self

    def _handle(self, step: _Step) -> None:
        out = self.outputs[0]
        out._last_token_ids_len = len(out.token_ids)
        out.token_ids.extend(step.token_ids)
        if step.finish is not None:
            self._done = True
            if step.finish == "stop_words":
                out.finish_reason = "stop"
                for stop in self.sampling_params._stop_words(self._llm.tokenizer):
                    if out.token_ids[-len(stop):] == stop:
                        out.stop_reason = self._llm.tokenizer.decode(stop)
                        if not self.sampling_params.include_stop_str_in_output:
                            out.token_ids = out.token_ids[: -len(stop)]
                        break
            else:
                out.finish_reason = {"end_id": "stop", "length": "length", "timeout": "timeout", "cancelled": "cancelled"}[step.finish]
        if self.sampling_params.detokenize:
            out._last_text_len = len(out.text)
            out.text = self._llm.tokenizer.decode(out.token_ids, skip_special_tokens=self.sampling_params.skip_special_tokens)


@dataclass
class Args:
    model: str
    tensor_parallel_size: int
    max_batch_size: int | None
    max_num_tokens: int | None
    max_seq_len: int | None
    kv_cache_config: KvCacheConfig | None
    scheduler_config: SchedulerConfig | None
    extra: dict[str, Any]


class LLM:
    """The double's engine: it 'generates' `continuation` one token per step."""

    instances: list["LLM"] = []
    continuation = STORY
    step_delay = 0.002  # seconds per engine step
    timeout_after: int | None = None  # end requests with finish_reason "timeout" after this many steps

    def __init__(
        self,
        model: str,
        *,
        tokenizer: Any = None,
        tensor_parallel_size: int = 1,
        max_batch_size: int | None = None,
        max_num_tokens: int | None = None,
        max_seq_len: int | None = None,
        kv_cache_config: KvCacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        **kwargs: Any,
    ) -> None:
        self.args = Args(model, tensor_parallel_size, max_batch_size, max_num_tokens, max_seq_len, kv_cache_config, scheduler_config, kwargs)
        self.tokenizer = WordTokenizer()
        self.requests: list[RequestOutput] = []
        self.aborts: list[int] = []
        self.running = 0  # requests the executor is still generating
        self.shut_down = False
        self._next_id = 0
        LLM.instances.append(self)

    def generate_async(self, inputs: Any, sampling_params: SamplingParams | None = None, streaming: bool = False, **kwargs: Any) -> RequestOutput:
        if self.shut_down:
            raise RuntimeError("LLM is shut down")
        params = sampling_params or SamplingParams()
        if isinstance(inputs, str):
            prompt_ids = self.tokenizer.encode(inputs)
        elif isinstance(inputs, list) and all(isinstance(t, int) for t in inputs):
            prompt_ids = list(inputs)
        else:
            raise TypeError(f"unsupported prompt inputs {type(inputs).__name__}")
        self._next_id += 1
        result = RequestOutput(self, self._next_id, prompt_ids, params)
        self.requests.append(result)
        return result

    async def _generate(self, result: RequestOutput) -> None:
        params = result.sampling_params
        plan = self.tokenizer.encode(self.continuation) + [self.tokenizer.eos_token_id]
        stops = params._stop_words(self.tokenizer)
        end_id = params.end_id if params.end_id is not None else self.tokenizer.eos_token_id
        generated: list[int] = []
        self.running += 1
        try:
            for step in range(len(plan) + params.max_tokens):
                await asyncio.sleep(self.step_delay)
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
                elif any(generated[-len(s):] == s for s in stops if s):
                    finish = "stop_words"
                elif len(generated) >= params.max_tokens:
                    finish = "length"
                result._responses.put_nowait(_Step([token], finish))
                if finish:
                    return
        finally:
            self.running -= 1

    def shutdown(self) -> None:
        self.shut_down = True


def modules() -> tuple[types.ModuleType, types.ModuleType]:
    """The double as the `tensorrt_llm` and `tensorrt_llm.llmapi` modules."""
    top = types.ModuleType("tensorrt_llm")
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    for name, value in {"LLM": LLM, "SamplingParams": SamplingParams, "CompletionOutput": CompletionOutput, "RequestOutput": RequestOutput}.items():
        setattr(top, name, value)
        setattr(llmapi, name, value)
    for name, value in {"KvCacheConfig": KvCacheConfig, "SchedulerConfig": SchedulerConfig, "CapacitySchedulerPolicy": CapacitySchedulerPolicy}.items():
        setattr(llmapi, name, value)
    top.llmapi = llmapi  # type: ignore[attr-defined]
    return top, llmapi


def install(monkeypatch: Any) -> types.ModuleType:
    """Makes `import tensorrt_llm` find the double for one test."""
    top, llmapi = modules()
    monkeypatch.setitem(sys.modules, "tensorrt_llm", top)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    return top
