"""The path of one streamed chat completion, counted as docs/architecture.md counts it.

    python bench/request_path.py            # the numbered path, then stops, files, crossings, back-ups
    python bench/request_path.py --json -   # the same as JSON

The shape counted: the `hf` engine behind the scheduler, Redis quotas (a key with limits), the
Postgres ledger with its journal, a priced model, no response-cache hit. The gateway runs in
process under uvicorn with the guarded protocol (bench/harness.py:ServerThread, as the tests run
it); one request warms it up, the next is recorded.

Rules (the tool's; docs/architecture.md's list is this tool's output):

- Recorded: the first entry (sys.setprofile's `call`, a coroutine's or generator's resumption
  included) of each function defined in gateway/, engines/ or billing/, on the server's thread,
  from the request's first byte until its ledger row has been written (the writer's round).
- A stop is where the path enters a file: a function whose caller's step is in another file. A
  call inside one file (a class's own helpers, a comprehension, a lambda) is the calling step's own
  work: not a stop, and what it calls counts as called by that step.
- Never stops, nor what they call: the value helpers named in VALUE_HELPERS (printed), and
  properties (reading a declared attribute: `engine.ready`, `engine.passthrough`, ...).
- Roots (tasks and loop callbacks) are stops, except those of NOT_OF_THE_REQUEST (printed): the
  connection's set-up, the Redis client's socket, periodic loops, this tool's flush barrier.
- Crossings: consecutive stops in different packages; a back-up is a crossing into gateway/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PACKAGES = ("gateway", "engines", "billing")

# Functions that compute a value for the step that calls them (by qualified name, `file:function`).
VALUE_HELPERS = (
    "gateway/http/requests.py:bearer_key",
    "gateway/http/requests.py:header",
    "engines/wrappers/router.py:router_of",
    "gateway/serving/admission.py:final_status",
    "billing/prices/book.py:EffectivePrice.cost_nanos",
    "gateway/serving/ratelimit.py:hold_headers",
    "gateway/serving/admission.py:Admission._record",
    "gateway/serving/admission.py:Admission.headers",
    "gateway/api/openai/protocol.py:*",  # a protocol model's accessors (`parse`, the parser, is a step)
    "billing/keys/store.py:Principal.*",  # may_use, the limits it carries
    "gateway/serving/completions.py:Generation.*",  # model, and the dataclass's fields
    "gateway/serving/completions.py:usage_body",
    "engines/base.py:*",  # EngineRequest/EngineOutput/SamplingParams accessors, Engine's defaults
    "billing/quota/base.py:Hold.*",
    "billing/quota/base.py:Scope.*",
)


def _helper(name: str) -> bool:
    return name != "gateway/api/openai/protocol.py:parse" and _matches(name, VALUE_HELPERS)


def _ours(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts and rel.parts[0] in PACKAGES else None


class Recorder:
    """First entries of our functions, each with the frame that called it (the nearest frame of ours)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str | None]] = []
        self._seen: set[Any] = set()
        self._files: dict[str, str | None] = {}

    def _file(self, filename: str) -> str | None:
        rel = self._files.get(filename, "?")
        if rel == "?":
            rel = self._files[filename] = _ours(filename)
        return rel

    def _name(self, frame: Any) -> str | None:
        rel = self._file(frame.f_code.co_filename)
        if rel is None:
            return None
        return f"{rel}:{frame.f_code.co_qualname}"

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code in self._seen:
            return
        name = self._name(frame)
        if name is None:
            return
        self._seen.add(frame.f_code)
        caller = frame.f_back
        while caller is not None and self._name(caller) is None:
            caller = caller.f_back
        self.entries.append((name, self._name(caller) if caller is not None else None))


# Tasks and callbacks on the server's loop that are not this request's: the connection's own
# set-up and tear-down, the Redis client's socket, periodic loops, the tool's own flush barrier.
NOT_OF_THE_REQUEST = (
    "gateway/http/hardening.py:GuardedHttpToolsProtocol.__init__",
    "gateway/http/hardening.py:GuardedHttpToolsProtocol.connection_made",
    "gateway/http/hardening.py:GuardedHttpToolsProtocol.connection_lost",
    "billing/quota/resp.py:*",
    "billing/periodic.py:every",
    "gateway/batches/runner.py:BatchRunner._round",
    "billing/quota/redis_limiter.py:RedisLimiter._watch_round",
    "billing/ledger/writer.py:LedgerWriter.flush*",
    "billing/keys/store.py:KeyStore._lookup",  # the key cache's refresh, in the background
    "billing/keys/store.py:KeyStore._refresh.<locals>.<lambda>",
    "billing/prices/book.py:PriceBook._load",  # the price book's refresh, in the background
)


def _is_property(name: str) -> bool:
    """Whether `file:Class.attr` is a property: reading a declared attribute is a value, not a step."""
    import importlib
    import inspect

    file, qual = name.split(":")
    parts = qual.split(".")
    if len(parts) != 2 or parts[0].startswith("<"):
        return False
    try:
        cls = getattr(importlib.import_module(file[:-3].replace("/", ".")), parts[0])
        return isinstance(inspect.getattr_static(cls, parts[1]), property)
    except (ImportError, AttributeError):
        return False


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)


def path_of(entries: list[tuple[str, str | None]]) -> list[str]:
    """The stops, in order, from the recorded first entries.

    A stop is where the path enters a file: a function whose caller's step is in another file
    (a root: a task or callback of the request, such as the writer's round). A call inside one file
    (a method calling its class's helpers, a comprehension, a lambda) is the calling step's own
    work: not a stop, and what it calls counts as called by that step. A value helper is never a
    stop, and what it calls is its own work."""
    stops: list[str] = []
    step: dict[str, str | None] = {}  # function -> the stop it is part of (None: dropped)
    for name, caller in entries:
        if caller is None:
            if _matches(name, NOT_OF_THE_REQUEST):
                step[name] = None
                continue
            owner = None
        else:
            owner = step.get(caller)
            if owner is None:
                step[name] = None  # the work of something not on the path (or of a value helper)
                continue
        if _helper(name) or _is_property(name):
            step[name] = None
            continue
        last = name.split(":")[1].split(".")[-1]
        if owner is not None and (owner.split(":")[0] == name.split(":")[0] or last.startswith("<")):
            step[name] = owner  # the same file's work, or an expression's frame: part of the step
            continue
        stops.append(name)
        step[name] = name
    return stops


def count(stops: list[str]) -> dict[str, Any]:
    packages = [s.split("/")[0] for s in stops]
    crossings = [(i, packages[i], packages[i + 1]) for i in range(len(stops) - 1) if packages[i] != packages[i + 1]]
    return {
        "stops": len(stops),
        "files": len({s.split(":")[0] for s in stops}),
        "crossings": len(crossings),
        "back_up": sum(1 for _, _, to in crossings if to == "gateway"),
        "folders": sum(1 for i in range(len(stops) - 1) if os.path.dirname(stops[i].split(":")[0]) != os.path.dirname(stops[i + 1].split(":")[0])),
    }


def record() -> list[tuple[str, str | None]]:
    import httpx

    from bench.harness import REDIS, ServerThread, delete_redis_keys, fresh_database, make_key
    from bench.overhead import LIMITS
    from billing import migrate
    from engines.backends.hf import HFEngine
    from gateway.app import create_app
    from gateway.config import DEFAULT_MODEL_ID, Settings, default_cache_dir

    secret = "path-secret-" + uuid.uuid4().hex
    prefix = f"tgpath:{uuid.uuid4().hex[:6]}:"
    engine = HFEngine(model_id=DEFAULT_MODEL_ID, max_batch_size=8, max_queue=16, cache_dir=default_cache_dir(os.environ))
    asyncio.run(engine.start())
    try:
        with fresh_database() as db, tempfile.TemporaryDirectory() as tmp:
            migrate.upgrade(db)
            admin = _admin_key(db, secret)
            settings = Settings(database_url=db, server_secret=secret, data_dir=Path(tmp)).with_overrides(
                redis={"url": REDIS, "prefix": prefix},
            )
            app = create_app(settings, engines={engine.model_id: engine})
            server = ServerThread(app).__enter__()
            try:
                base = f"http://127.0.0.1:{server.port}"
                h = {"Authorization": f"Bearer {admin}"}
                httpx.post(f"{base}/admin/prices", headers=h, json={"model": engine.model_id, "input_per_million": "0.150",
                                                                     "output_per_million": "0.600"}).raise_for_status()
                key = make_key(base, admin, limits=LIMITS)
                body = {"model": engine.model_id, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                        "temperature": 0, "stream": True}
                loop = app.state.ledger._task.get_loop()
                _stream(base, key, body)  # warm: first-time imports and caches off the recorded path
                _flushed(app, loop)
                recorder = Recorder()
                started = threading.Event()

                def on(rec: Any) -> None:
                    sys.setprofile(rec)
                    started.set()

                loop.call_soon_threadsafe(on, recorder)
                started.wait(10)
                _stream(base, key, body)
                _flushed(app, loop)  # the row is in its batch: the writer's round has run
                stopped = threading.Event()
                loop.call_soon_threadsafe(lambda: (sys.setprofile(None), stopped.set()))
                stopped.wait(10)
                return recorder.entries
            finally:
                server.__exit__()
                delete_redis_keys(prefix)
    finally:
        asyncio.run(engine.stop())


def _stream(base: str, key: str, body: dict[str, Any]) -> None:
    import httpx

    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for _ in r.iter_bytes():
            pass


def _flushed(app: Any, loop: asyncio.AbstractEventLoop) -> None:
    asyncio.run_coroutine_threadsafe(app.state.ledger.flush(timeout=30), loop).result(60)
    deadline = time.monotonic() + 10
    while app.state.service.live_count() and time.monotonic() < deadline:
        time.sleep(0.01)


def _admin_key(db: str, secret: str) -> str:
    from billing.db import create_engine
    from billing.keys.store import KeyStore

    async def make() -> str:
        engine = create_engine(db)
        try:
            keys = KeyStore(engine, secret.encode())
            account = await keys.ensure_account("admin")
            return str((await keys.create_key(account["id"], name="path admin", is_admin=True))["key"])
        finally:
            await engine.dispose()

    return asyncio.run(make())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the path and counts as JSON here ('-': stdout only)")
    parser.add_argument("--raw", action="store_true", help="print every first entry (with its caller) too")
    parser.add_argument("--entries", help="save the recorded first entries here, or count the ones saved there")
    args = parser.parse_args()
    if args.entries and Path(args.entries).exists():
        entries = [tuple(e) for e in json.loads(Path(args.entries).read_text())]
    else:
        entries = record()
        if args.entries:
            Path(args.entries).write_text(json.dumps(entries))
    stops = path_of(entries)
    counts = count(stops)
    if args.json == "-":
        print(json.dumps({"path": stops, **counts}, indent=1))
        return
    if args.raw:
        for name, caller in entries:
            print(f"   {name}  <- {caller}")
    print("value helpers (never stops):", ", ".join(VALUE_HELPERS))
    print("not of the request:", ", ".join(NOT_OF_THE_REQUEST))
    for i, stop in enumerate(stops, 1):
        print(f"{i:2d}. `{stop}`")
    print(f"{counts['stops']} stops in {counts['files']} files; {counts['crossings']} crossings between packages "
          f"({counts['back_up']} back up into gateway/); {counts['folders']} between folders")
    if args.json:
        Path(args.json).write_text(json.dumps({"path": stops, **counts}, indent=1))


if __name__ == "__main__":
    main()
