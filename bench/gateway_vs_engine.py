"""Tollgate in front of an engine against the same engine reached directly, in one run.

    .venv/bin/python bench/gateway_vs_engine.py [--num-requests 300] [--concurrency 16 32] [--tokens 64] [--token-delay 0.01]

Starts, each in its own process, a stand-in OpenAI-compatible engine (tests/fakes/upstream.py:
a fixed number of chunks at a fixed pace, with usage) and `tollgate serve` with a models.yaml
whose `openai` pool is that engine (SQLite ledger, in-process quotas). Then `tollgate bench`
sends the same requests to both, at each concurrency, and prints one table per concurrency with
the ratio tollgate/direct. Run it from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.cli.bench import Target, make_workload, run_target, table

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "bench" / "results" / "gateway_vs_engine.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not become ready")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--tokens", type=int, default=64, help="chunks (tokens) per answer from the stand-in engine")
    parser.add_argument("--token-delay", type=float, default=0.01, help="seconds between the engine's chunks")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="tollgate-bench-"))
    engine_port, gateway_port = free_port(), free_port()
    admin_key = "sk-" + secrets.token_urlsafe(32)
    (tmp / "models.yaml").write_text(
        "models:\n  - id: fronted\n    backend: openai\n    context_length: 8192\n"
        f"    replicas: [http://127.0.0.1:{engine_port}/v1]\n    upstream_model: stand-in\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(TOLLGATE_DATA_DIR=str(tmp), DATABASE_URL=f"sqlite:///{tmp / 'tollgate.db'}", TOLLGATE_MODELS=str(tmp / "models.yaml"),
               TOLLGATE_ADMIN_KEY=admin_key, TOLLGATE_PORT=str(gateway_port), PYTHONPATH=str(ROOT))
    processes = [
        subprocess.Popen([sys.executable, "-m", "tests.fakes.upstream", "--port", str(engine_port), "--tokens", str(args.tokens),
                          "--token-delay", str(args.token_delay)], cwd=ROOT, env=env),
        subprocess.Popen([str(Path(sys.executable).parent / "tollgate"), "serve", "--log-level", "warning"], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=(tmp / "gateway.log").open("w")),
    ]
    reports: list[dict[str, Any]] = []
    try:
        wait_ready(f"http://127.0.0.1:{engine_port}/health")
        wait_ready(f"http://127.0.0.1:{gateway_port}/readyz")
        targets = [
            Target("direct", f"http://127.0.0.1:{engine_port}/v1", "", "stand-in"),
            Target("tollgate", f"http://127.0.0.1:{gateway_port}/v1", admin_key, "fronted"),
        ]
        workload = make_workload(args.num_requests, args.input_len, args.tokens, 0.0, seed=0)
        import asyncio

        for concurrency in args.concurrency:
            runs = [asyncio.run(run_target(t, workload, endpoint="chat", concurrency=concurrency, request_rate=None,
                                           ignore_eos=False, seed=0, progress=sys.stderr.isatty(), timeout=120.0)) for t in targets]
            print(f"\nconcurrency {concurrency}, {args.num_requests} requests, {args.tokens} tokens each at "
                  f"{args.token_delay * 1000:g} ms per token from the engine\n")
            print(table(runs))
            reports += runs
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=10)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(reports, indent=2) + "\n")
    return 0 if all(r["failed"] == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
