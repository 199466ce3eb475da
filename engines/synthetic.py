"""`synthetic` backend: an engine process with no model, for measuring the gateway's relay.

It speaks the `hf` engine process's messages (engines/hf_process.py) over the same pipe: the
gateway side is `HFProcessEngine` as is, with its real tokenizer (the embedded SmolLM2's), so
detokenizing, stop strings, metering and SSE cost what they cost with a model. The child only
emits token ids: every `step_ms` each running stream gets its next `tokens_per_step` ids (a fixed
English text's, in a loop), in one message per step, until its max_tokens. At most
`max_batch_size` streams run at once; the rest wait in order, as in a real engine. Benchmarks
only (bench/relay.py): what it writes is not a model's answer.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engines.hf_process import HFProcessEngine

log = logging.getLogger("tollgate.engines.synthetic")

# What the streams "generate": prose with punctuation, digits and a few multi-byte characters, so
# incremental detokenization meets the cases it meets with a model.
TEXT = (
    "The gateway relays every token it is given: it turns ids into text, watches for stop strings, "
    "counts what the account will pay for and writes one event per step to each client. In 2026 a "
    "single engine on one accelerator makes tens of thousands of tokens a second — café, naïve, "
    "straße — and the relay in front of it must keep up, or the engine waits for the gateway. "
)


class SyntheticEngine(HFProcessEngine):
    owned_by = "tollgate-synthetic"
    child_module = "engines.synthetic"

    def __init__(self, *, model_id: str, step_ms: float = 10.0, tokens_per_step: int = 1, max_batch_size: int = 256,
                 max_queue: int = 256, context_length: int = 8192, cache_dir: Path | None = None, gather_ms: float = 0.0) -> None:
        if step_ms <= 0 or tokens_per_step < 1:
            raise ValueError("step_ms must be above 0 and tokens_per_step at least 1")
        super().__init__(model_id=model_id, gather_ms=gather_ms, cache_dir=cache_dir, max_batch_size=max_batch_size, max_queue=max_queue, warmup=False)
        self._params = {"step_ms": float(step_ms), "tokens_per_step": int(tokens_per_step), "max_batch_size": int(max_batch_size),
                        "context_length": int(context_length), "cache_dir": str(self._cache_dir)}


def load_tokenizer(cache_dir: Path) -> Any:
    """The embedded model's tokenizer: read from its GGUF once (seconds), then from a saved copy."""
    from transformers import AutoTokenizer

    from engines.hf import bundled_gguf_path, converted_dir

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


class _Stream:
    __slots__ = ("rid", "max_tokens", "sent", "pos", "queued_at")

    def __init__(self, rid: str, max_tokens: int, pos: int, queued_at: float) -> None:
        self.rid, self.max_tokens, self.sent, self.pos, self.queued_at = rid, max_tokens, 0, pos, queued_at


def engine_main(fd: int) -> None:
    conn = Connection(fd)
    model_id, params, _gather_ms = conn.recv()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    try:
        tokenizer = load_tokenizer(Path(params["cache_dir"]))
    except BaseException as exc:
        conn.send(("failed", f"synthetic engine {model_id!r}: no tokenizer: {type(exc).__name__}: {exc}"))
        return
    ids = [int(t) for t in tokenizer(TEXT, add_special_tokens=False)["input_ids"]]
    eos = tokenizer.eos_token_id
    info = {"context_length": params["context_length"], "vocab_size": len(tokenizer), "eos_ids": [int(eos)] if eos is not None else [], "guided": False}
    conn.send(("ready", info, tokenizer))
    _run(conn, ids, params["step_ms"] / 1000.0, params["tokens_per_step"], params["max_batch_size"])


def _run(conn: Any, ids: list[int], step_s: float, per_step: int, batch_size: int) -> None:
    """One thread: commands are read between steps; a step is due every `step_s` (a late one is not made up)."""
    running: dict[str, _Stream] = {}
    waiting: deque[_Stream] = deque()
    cycle = ids * (per_step // len(ids) + 2)  # a slice of per_step ids never wraps
    size = len(ids)
    added = 0
    due = time.monotonic() + step_s
    while True:
        timeout = due - time.monotonic()
        try:
            while conn.poll(max(0.0, timeout)):
                message = conn.recv()
                kind = message[0]
                if kind == "add":
                    waiting.append(_Stream(message[1], int(message[3]), (added * 7) % size, time.monotonic()))
                    added += 1
                elif kind == "cancel":
                    rid = message[1]
                    if running.pop(rid, None) is None:
                        for s in waiting:
                            if s.rid == rid:
                                waiting.remove(s)
                                break
                elif kind == "held":
                    conn.send(("held", message[1], len(running) + len(waiting)))
                elif kind == "stop":
                    return
                timeout = due - time.monotonic()
                if timeout <= 0:
                    break
        except (EOFError, OSError):
            return  # the gateway closed the pipe or died
        now = time.monotonic()
        due = max(due + step_s, now)
        batch: list[tuple[Any, ...]] = []
        while waiting and len(running) < batch_size:
            s = waiting.popleft()
            running[s.rid] = s
        finished = []
        for s in running.values():
            n = min(per_step, s.max_tokens - s.sent)
            queue_ms = (now - s.queued_at) * 1000.0 if not s.sent else None
            s.sent += n
            done = s.sent >= s.max_tokens
            batch.append((s.rid, cycle[s.pos:s.pos + n], done, None, queue_ms))
            s.pos = (s.pos + n) % size
            if done:
                finished.append(s.rid)
        for rid in finished:
            del running[rid]
        if batch:
            try:
                conn.send(batch)
            except (EOFError, OSError):
                return


if __name__ == "__main__":
    engine_main(int(sys.argv[1]))
