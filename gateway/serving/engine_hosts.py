"""One engine process shared by the workers of `tollgate serve --workers N`.

The supervisor (the process that starts the workers) starts each `hf` model's engine process
(`process: true`), each `synthetic` one and each `trtllm` model's LLM (engines/backends/trtllm_host.py)
before the workers, as an engine host: it listens on a Unix socket under the data directory and
every worker's `HFProcessEngine` (or `TRTLLMEngine`) connects to it instead of starting a child or
an LLM of its own (`connect_to`). The model loads once, the engine's batch is one, and
each worker admits, meters and streams its own requests (detokenizing too: that is the work that
more processes share). The scheduler's queue for such an engine lives in the host
(engines/wrappers/scheduler.py:HostQueue), the one place that sees every worker's requests; each worker's
own scheduler passes them on. Quotas (Redis) and the ledger (Postgres) were shared already.

    supervisor:  EngineHosts.start()  --spawns-->  engine host (engines/backends/hf_process.py, _host)
    worker 1..N: HFProcessEngine.connect_to = socket  <--one connection each-->  the host's one batch
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from engines.base import Engine
from gateway.config import Settings

# How long a worker's start waits for its engine hosts: each has loaded its model before any worker
# starts, so this is a connection and the host's hello (seconds on a loaded machine), not a load.
CONNECT_TIMEOUT_S = 60.0
# How long a worker's start waits for the models it loads itself (an `openai` pool: its tokenizer and
# its first health round, each bounded by its own timeouts). Past it the worker accepts anyway, and
# its /readyz says which model is still loading.
LOAD_WAIT_S = 300.0

log = logging.getLogger("tollgate")


def hosted(spec: Any) -> bool:
    """Whether a models-file entry runs in an engine process that workers can share."""
    if spec.backend in ("synthetic", "trtllm"):
        return True
    if spec.backend != "hf":
        return False
    separate = spec.params.get("process")
    return bool(separate) if separate is not None else str(spec.params.get("device", "cpu")).startswith("cuda")


class EngineHosts:
    """The supervisor's engine hosts: started before the workers, stopped after them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engines: list[Any] = []
        self.sockets: dict[str, str] = {}  # model id -> the host's socket

    def start(self) -> dict[str, str]:
        from engines.backends.hf_process import HFProcessEngine
        from engines.registry import build_engine, load_models
        from engines.backends.trtllm_host import TRTLLMHost

        settings = self.settings
        table = load_models(settings.engines.models_file, environ=settings.engines.environ)  # type: ignore[arg-type]
        sched = settings.scheduler
        queue = {"classes": [(c.name, c.max_wait) for c in sched.priority_classes], "reserve": sched.reserve,
                 "max_queue": sched.max_queue} if sched.enabled else None
        for i, spec in enumerate(s for s in table.specs.values() if hosted(s)):
            engine: Any
            if spec.backend == "trtllm":  # the LLM in an engine host of its own (engines/backends/trtllm_host.py)
                engine = TRTLLMHost(model_id=spec.id, params={"context_length": spec.context_length, **spec.params})
            else:
                engine = build_engine(spec, cache_dir=settings.engines.cache_dir)
                assert isinstance(engine, HFProcessEngine)
            path = Path(settings.data_dir).resolve() / f"engine-{settings.http.port}-{i}.sock"
            path.unlink(missing_ok=True)
            engine.host = {"listen": str(path), "scheduler": queue}
            asyncio.run(engine.start())  # loads the model once, here, before any worker asks for it
            self.engines.append(engine)
            self.sockets[spec.id] = str(path)
        return self.sockets

    def stop(self) -> None:
        for engine in self.engines:
            asyncio.run(engine.stop())
        for path in self.sockets.values():
            Path(path).unlink(missing_ok=True)


def _hosted_runners(chain: Engine, sockets: dict[str, str]) -> list[Engine]:
    """The engines of a served model that run in an engine host of the supervisor's: before the
    scheduler wraps them (a worker's build) and after (its start), where a runner may be a
    ScheduledEngine around one."""
    from engines.backends.hf_process import HFProcessEngine
    from engines.backends.trtllm import TRTLLMEngine

    engines = (r.unwrapped() for r in chain.runners())
    return [e for e in engines if isinstance(e, (HFProcessEngine, TRTLLMEngine)) and e.model_id in sockets]


def connect_hosted(engines: dict[str, Engine], sockets: dict[str, str]) -> None:
    """In a worker: each engine the supervisor hosts connects to its host instead of starting its own."""
    for chain in engines.values():
        for engine in _hosted_runners(chain, sockets):
            engine.connect_to = sockets[engine.model_id]


async def await_loads(served: dict[str, Engine], loads: list[asyncio.Task[None]], sockets: dict[str, str],
                     timeout: float | None = None, own_timeout: float | None = None) -> None:
    """In a worker's start, before it accepts a connection (uvicorn accepts once the app's startup
    has ended): every model's load. Otherwise a worker could take requests (503 engine_not_ready)
    while another worker's /readyz already says ready. For a model an engine host runs that is the
    connection to the host and its hello: one that has not ended within `timeout` stops this
    worker's start, saying which. A model the worker loads itself (an `openai` pool's tokenizer and
    first health round) gets `own_timeout`, then the worker accepts anyway, logging which is still
    loading. A load that fails is the load watcher's to report (/readyz says why)."""
    hosted = {mid: task for (mid, engine), task in zip(served.items(), loads) if _hosted_runners(engine, sockets)}
    own = {mid: task for mid, task in zip(served, loads) if mid not in hosted}
    limit = CONNECT_TIMEOUT_S if timeout is None else timeout
    if hosted:
        await asyncio.wait([asyncio.shield(t) for t in hosted.values()], timeout=limit)
        late = [mid for mid, task in hosted.items() if not task.done()]
        if late:
            raise RuntimeError(f"the engine host of {', '.join(late)} did not answer this worker's connection within {limit:g} s; "
                               "is the supervisor's engine host running?")
    if own:
        own_limit = LOAD_WAIT_S if own_timeout is None else own_timeout
        await asyncio.wait([asyncio.shield(t) for t in own.values()], timeout=own_limit)
        late = [mid for mid, task in own.items() if not task.done()]
        if late:
            log.warning("this worker accepts before %s has loaded (%g s): its /readyz answers 503 until then", ", ".join(late), own_limit)
