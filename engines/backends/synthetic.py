"""`synthetic` backend: an engine process with no model, for measuring the gateway's relay.

It speaks the `hf` engine process's messages (engines/backends/hf_process.py) over the same pipe: the
gateway side is `HFProcessEngine` as is, with its real tokenizer (the embedded SmolLM2's), so
detokenizing, stop strings, metering and SSE cost what they cost with a model. The child only
emits token ids: every `step_ms` (on a monotonic clock: a late timer's wake runs every step that is due) each running stream gets its next `tokens_per_step` ids (a fixed
English text's, in a loop), in one message per step, until its max_tokens. At most
`max_batch_size` streams run at once; the rest wait in order, as in a real engine. The child is
engines/backends/hf_process.py's engine process with `SyntheticCore` in place of the model, so the same
process can be shared by several gateway workers. Benchmarks only (bench/relay.py): what it
writes is not a model's answer.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

from engines.backends.hf_process import HFProcessEngine

log = logging.getLogger("tollgate.engines.synthetic")

# What the streams "generate": prose with punctuation, digits and a few multi-byte characters, so
# incremental detokenization meets the cases it meets with a model.
TEXT = (
    "The gateway relays every token it is given: it turns ids into text, watches for stop strings, "
    "counts what the account will pay for and writes one event per step to each client. In 2026 a "
    "single engine on one accelerator makes tens of thousands of tokens a second — café, naïve, "
    "straße — and the relay in front of it must keep up, or the engine waits for the gateway. "
)


# How far behind its clock a late wake catches up: far past a timer's lateness (whole milliseconds),
# well short of a stall's.
CATCH_UP_S = 0.02


class SyntheticEngine(HFProcessEngine):
    owned_by = "tollgate-synthetic"
    child_module = "engines.backends.synthetic"

    def __init__(self, *, model_id: str, step_ms: float = 10.0, tokens_per_step: int = 1, max_batch_size: int = 256,
                 max_queue: int = 256, context_length: int = 8192, cache_dir: Path | None = None, gather_ms: float = 0.0,
                 tokenizer: str | None = None) -> None:
        if step_ms <= 0 or tokens_per_step < 1:
            raise ValueError("step_ms must be above 0 and tokens_per_step at least 1")
        super().__init__(model_id=model_id, gather_ms=gather_ms, cache_dir=cache_dir, max_batch_size=max_batch_size, max_queue=max_queue, warmup=False)
        self._params = {"step_ms": float(step_ms), "tokens_per_step": int(tokens_per_step), "max_batch_size": int(max_batch_size),
                        "context_length": int(context_length), "cache_dir": str(self._cache_dir), "tokenizer": tokenizer}


def load_tokenizer(cache_dir: Path, folder: str | None = None) -> Any:
    """`folder`'s tokenizer (a saved copy of the embedded model's, where its package is not installed),
    else the embedded model's: read from its GGUF once (seconds), then from a saved copy."""
    from transformers import AutoTokenizer

    if folder:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    from engines.backends.hf import bundled_gguf_path, converted_dir

    gguf = bundled_gguf_path()
    converted = converted_dir(gguf, cache_dir)
    for ready in (converted, converted.with_name(converted.name + "-tokenizer")):
        if (ready / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(ready, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target = converted.with_name(converted.name + "-tokenizer")
    tmp = target.with_name(target.name + f".tmp{__import__('os').getpid()}")
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process saved it first
        pass
    return tokenizer


class _Output:
    """What the batching manager hands a result handler, as far as engines/backends/hf_process.py reads it."""

    __slots__ = ("generated_tokens", "created_time", "lifespan", "error", "done")

    def __init__(self, now: float) -> None:
        self.generated_tokens: list[int] = []
        self.created_time = now
        self.lifespan = (-1.0, -1.0)
        self.error: str | None = None
        self.done = False

    def is_finished(self) -> bool:
        return self.done


class SyntheticCore:
    """The engine in the engine process: `HFEngine`'s face towards engines/backends/hf_process.py (submit,
    cancel, one handler call per stream per step) with a timer instead of a model."""

    def __init__(self, *, model_id: str, step_ms: float, tokens_per_step: int, max_batch_size: int, context_length: int, cache_dir: str,
                 tokenizer: str | None = None) -> None:
        self.model_id = model_id
        self._step_s = step_ms / 1000.0
        self._per_step = tokens_per_step
        self._max_batch_size = max_batch_size
        self._max_batch_tokens = 0
        self.context_length = context_length
        self._cache_dir = Path(cache_dir)
        self._tokenizer_folder = tokenizer
        self.guided = False
        self.tokenizer: Any = None
        self.vocab_size = 0
        self._eos_ids: set[int] = set()
        self._running: dict[str, tuple[_Output, Any, int, int]] = {}  # rid -> (output, handler, max_tokens, position)
        self._waiting: dict[str, tuple[_Output, Any, int]] = {}
        self._ids: list[int] = []
        self._timer: Any = None
        self._due = 0.0  # the loop time of the next step
        self._added = 0

    async def start(self) -> None:
        self.tokenizer = load_tokenizer(self._cache_dir, self._tokenizer_folder)
        self._ids = [int(t) for t in self.tokenizer(TEXT, add_special_tokens=False)["input_ids"]]
        self._cycle = self._ids * (self._per_step // len(self._ids) + 2)  # a slice of per_step ids never wraps
        self.vocab_size = len(self.tokenizer)
        eos = self.tokenizer.eos_token_id
        self._eos_ids = {int(eos)} if eos is not None else set()

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def guide_failure(self, rid: str) -> str | None:
        return None

    def submit(self, rid: str, prompt_ids: list[int], max_tokens: int, sampling: Any, handler: Any, grammar: str | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._waiting[rid] = (_Output(time.time()), handler, max_tokens)
        if self._timer is None:
            self._due = loop.time() + self._step_s
            self._timer = loop.call_at(self._due, self._tick)

    def _cancel(self, rid: str) -> None:
        if self._running.pop(rid, None) is None:
            self._waiting.pop(rid, None)

    def _tick(self) -> None:
        """Every step that is due by now. The steps are laid on the loop's monotonic clock, `step_s`
        apart from the first: a timer wakes late (epoll counts in whole milliseconds, a busy machine
        later still), so a wake runs each step whose time has come, one after the other, and the
        engine keeps its rate whatever the timer's resolution. Each step is what a real engine's step
        gives (its handler calls, its admissions and ends); several of them reach the gateway in one
        message, as a real engine's steps do when they come faster than the gateway reads them. A
        wake later than CATCH_UP_S (this process stalled: the pipe full, a gateway behind) pays back
        only that much: an engine held up does not make its missed steps later in a burst."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._due = max(self._due, now - CATCH_UP_S)
        while self._due <= now and (self._running or self._waiting):
            self._step()
            self._due += self._step_s
        if self._running or self._waiting:
            self._timer = loop.call_at(self._due, self._tick)
        else:
            self._timer = None

    def _step(self) -> None:
        now = time.time()
        size = len(self._ids)
        while self._waiting and len(self._running) < self._max_batch_size:
            rid = next(iter(self._waiting))
            out, handler, max_tokens = self._waiting.pop(rid)
            out.lifespan = (now, -1.0)
            self._running[rid] = (out, handler, max_tokens, (self._added * 7) % size)
            self._added += 1
        ended = []
        for rid, (out, handler, max_tokens, pos) in self._running.items():
            n = min(self._per_step, max_tokens - len(out.generated_tokens))
            out.generated_tokens += self._cycle[pos:pos + n]
            if len(out.generated_tokens) >= max_tokens:
                out.done = True
                ended.append(rid)
            else:
                self._running[rid] = (out, handler, max_tokens, (pos + n) % size)
            handler(out)
        for rid in ended:
            self._running.pop(rid, None)


if __name__ == "__main__":
    from engines.backends.hf_process import engine_main

    engine_main(int(sys.argv[1]), make=SyntheticCore)
