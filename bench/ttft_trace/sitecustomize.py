"""Per-hop timing of each request's first token, for bench/gpu_ttft_trace.py only.

Python imports `sitecustomize` at start when its folder is on PYTHONPATH; the bench puts this folder
there for `tollgate serve` (and so for its engine process, which inherits the environment) and sets
TOLLGATE_TTFT_TRACE to a folder. Each process then appends one JSON line per event to a file of its
own there. Times are time.perf_counter(), which on Linux is CLOCK_MONOTONIC: one clock for every
process on the machine, so hops between processes can be subtracted. Nothing here runs without the
variable, and nothing in the project imports it.
"""

from __future__ import annotations

import os

if os.environ.get("TOLLGATE_TTFT_TRACE"):
    import json
    import time
    from pathlib import Path

    _out = open(Path(os.environ["TOLLGATE_TTFT_TRACE"]) / f"trace-{os.getpid()}.jsonl", "a", buffering=1)

    def _event(kind: str, **fields: object) -> None:
        _out.write(json.dumps({"ev": kind, **fields}) + "\n")

    def _key(ids: list[int]) -> str:
        return ",".join(str(i) for i in ids[:12])

    def _patch_gateway() -> None:
        from multiprocessing.connection import Connection


        from engines.backends import hf_process
        from gateway.http import requests as http

        # The handler's body read (gateway/http/requests.py read_json): when the route starts on the request,
        # after HTTP parsing, routing and middleware; keyed by the prompt's first ids, since the engine
        # may run the request on another task. Patched before any gateway module imports it by name.
        read_json = http.read_json

        async def traced_read_json(request, limit):  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            value = await read_json(request, limit)
            prompt = value.get("prompt") if isinstance(value, dict) else None
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                _event("g_body", key=_key(prompt), t=started, done=time.perf_counter())
            return value

        http.read_json = traced_read_json

        for cls in (hf_process.HFProcessEngine, hf_process.HFEngine):
            cls.stream = _traced_stream(cls.__dict__["stream"])  # type: ignore[method-assign]

        send_ = hf_process.HFProcessEngine._send

        def traced_send(self, message):  # type: ignore[no-untyped-def]
            send_(self, message)
            if message[0] == "add":
                _event("g_add_sent", rid=message[1], t=time.perf_counter())

        hf_process.HFProcessEngine._send = traced_send  # type: ignore[method-assign]

        put_all = hf_process._put_all
        seen: set[str] = set()

        def traced_put_all(items):  # type: ignore[no-untyped-def]
            now = time.perf_counter()
            for _queue, item in items:
                if isinstance(item, tuple) and item[1] and item[0] not in seen:
                    seen.add(item[0])
                    _event("g_put", rid=item[0], t=now)
            put_all(items)

        hf_process._put_all = traced_put_all

        # The engine process runs `python -m engines.backends.hf_process`: its module is __main__, not the one
        # patched above, so its side is traced through what both share (HFEngine.submit, Connection.send).
        submit = hf_process.HFEngine.submit
        pending: set[str] = set()

        def traced_submit(self, rid, prompt_ids, max_tokens, sampling, handler):  # type: ignore[no-untyped-def]
            _event("c_add", rid=rid, t=time.perf_counter())
            first = [True]

            def traced_handler(out):  # type: ignore[no-untyped-def]
                if first[0] and len(out.generated_tokens) > 0:
                    first[0] = False
                    pending.add(rid)
                    _event("c_out", rid=rid, t=time.perf_counter(), sched=out.lifespan[0], created=out.created_time)
                handler(out)

            submit(self, rid, prompt_ids, max_tokens, sampling, traced_handler)

        hf_process.HFEngine.submit = traced_submit  # type: ignore[method-assign]

        conn_send = Connection.send

        def traced_conn_send(self, obj):  # type: ignore[no-untyped-def]
            if isinstance(obj, list) and pending:
                now = time.perf_counter()
                for item in obj:
                    if item[0] in pending:
                        pending.discard(item[0])
                        _event("c_flush", rid=item[0], t=now, batch=len(obj))
            conn_send(self, obj)

        Connection.send = traced_conn_send  # type: ignore[method-assign]

    def _traced_stream(stream):  # type: ignore[no-untyped-def]
        async def traced_stream(self, request):  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            ids = self.prompt_ids_of(request)
            _event("g_stream", rid=request.request_id, key=_key(ids), t=started)
            first = True
            async for out in stream(self, request):
                if first and out.text:
                    first = False
                    _event("g_yield", rid=request.request_id, t=time.perf_counter())
                yield out

        return traced_stream

    try:
        _patch_gateway()
    except Exception as exc:  # noqa: BLE001 - a bench aid: say so and run untraced
        _event("trace_failed", error=repr(exc))
