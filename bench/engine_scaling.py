"""Engine scaling: aggregate output tokens/s at several concurrent streams, straight into the
engine and through the gateway (HTTP, auth, metering), with one model loaded once.

    .venv/bin/python bench/engine_scaling.py [--rounds 3] [--max-tokens 48] [--concurrency 1 4 16]

Each (mode, concurrency) cell runs once per round, direct and gateway interleaved; the table
shows medians. Tokens are the completion tokens actually generated, not max_tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from bench.harness import ServerThread
from billing import migrate
from billing.db import create_engine
from billing.keys.store import KeyStore
from engines.base import EngineRequest, SamplingParams
from engines.backends.hf import HFEngine
from gateway.app import create_app
from gateway.config import DEFAULT_MODEL_ID, Settings, default_cache_dir

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "engine_scaling.json"
MIN_SCALING = 3.0
MIN_GATEWAY_RATIO = 0.9
# Open-ended prompts, so greedy decoding rarely reaches EOS before max_tokens.
TOPICS = ["a lighthouse keeper", "a lost robot", "a city under the sea", "a dragon who hates fire",
          "two rival bakers", "a train that never stops", "a forgotten library", "a comet's journey"]

StreamFn = Callable[[list[dict[str, str]], int], Awaitable[int]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="repeats of every cell (default 3); medians are reported")
    parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens per stream (default 48)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="concurrent streams (default 1 4 16)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="results file (default bench/results/engine_scaling.json)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs (default cpu)")
    return parser.parse_args(argv)


def story_prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]


# streams ------------------------------------------------------------------------------------------
def direct_streamer(engine: HFEngine) -> StreamFn:
    async def run(messages: list[dict[str, str]], max_tokens: int) -> int:
        request = EngineRequest(
            request_id=uuid.uuid4().hex,
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=0),
            prompt_token_ids=engine.encode_chat(messages),
        )
        completion_tokens = 0
        async for out in engine.stream(request):
            completion_tokens = out.completion_tokens
        return completion_tokens

    return run


def gateway_streamer(client: AsyncOpenAI, model: str) -> StreamFn:
    async def run(messages: list[dict[str, str]], max_tokens: int) -> int:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True},
        )
        completion_tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
        return completion_tokens

    return run


async def measure(stream: StreamFn, concurrency: int, max_tokens: int) -> dict[str, float]:
    """Aggregate throughput of `concurrency` streams started together, first start to last end."""
    started = time.perf_counter()
    counts = await asyncio.gather(*(stream(story_prompt(i), max_tokens) for i in range(concurrency)))
    seconds = time.perf_counter() - started
    tokens = sum(counts)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


# gateway ------------------------------------------------------------------------------------------
async def customer_key(db_url: str, secret: str) -> str:
    """Migrates a fresh database and returns a customer key (next to the usual admin key)."""
    migrate.upgrade(db_url)
    db = create_engine(db_url)
    try:
        keys = KeyStore(db, secret.encode())
        await keys.ensure_admin_key(None)
        account = await keys.create_account("bench")
        return str((await keys.create_key(account["id"], name="bench"))["key"])
    finally:
        await db.dispose()


# report -------------------------------------------------------------------------------------------
def summarize(samples: dict[str, dict[int, list[dict[str, float]]]], levels: list[int]) -> list[dict[str, float]]:
    median = {mode: {c: statistics.median(s["tok_s"] for s in samples[mode][c]) for c in levels} for mode in samples}
    base = min(levels)
    return [
        {
            "concurrency": c,
            "direct_tok_s": median["direct"][c],
            "gateway_tok_s": median["gateway"][c],
            "gateway_over_direct": median["gateway"][c] / median["direct"][c],
            "direct_scaling": median["direct"][c] / median["direct"][base],
            "gateway_scaling": median["gateway"][c] / median["gateway"][base],
        }
        for c in levels
    ]


def run_checks(rows: list[dict[str, float]]) -> list[dict[str, Any]]:
    low, high = rows[0], rows[-1]
    worst = min(rows, key=lambda r: r["gateway_over_direct"])
    checks = [{
        "name": f"gateway >= {MIN_GATEWAY_RATIO:.0%} of direct (worst at concurrency {worst['concurrency']:.0f}: {worst['gateway_over_direct']:.0%})",
        "passed": worst["gateway_over_direct"] >= MIN_GATEWAY_RATIO,
    }]
    if high is not low:
        # Scaling is the engine's property, so it is judged on the direct numbers.
        checks.insert(0, {
            "name": f"{high['concurrency']:.0f} streams >= {MIN_SCALING:.0f}x {low['concurrency']:.0f} stream (direct: {high['direct_scaling']:.2f}x)",
            "passed": high["direct_scaling"] >= MIN_SCALING,
        })
    return checks


def print_table(result: dict[str, Any]) -> None:
    header = ["concurrency", "direct tok/s", "gateway tok/s", "gateway/direct", "scaling direct", "scaling gateway"]
    load = result["loadavg_at_start"][0]
    print(f"\nmedian of {result['rounds']} round(s), {result['max_tokens']} max tokens, {result['cpus']} CPUs, load average at start {load:.2f}")
    print(" | ".join(header))
    print(" | ".join("-" * len(h) for h in header))
    for r in result["summary"]:
        cells = [f"{r['concurrency']:.0f}", f"{r['direct_tok_s']:.1f}", f"{r['gateway_tok_s']:.1f}",
                 f"{r['gateway_over_direct']:.2f}", f"{r['direct_scaling']:.2f}x", f"{r['gateway_scaling']:.2f}x"]
        print(" | ".join(c.rjust(len(h)) for c, h in zip(cells, header)))
    print()
    for check in result["checks"]:
        print(f"{'PASS' if check['passed'] else 'FAIL'}  {check['name']}")


# main ---------------------------------------------------------------------------------------------
async def run_rounds(modes: dict[str, StreamFn], args: argparse.Namespace) -> dict[str, dict[int, list[dict[str, float]]]]:
    samples: dict[str, dict[int, list[dict[str, float]]]] = {m: {c: [] for c in args.concurrency} for m in modes}
    order = list(modes)
    for round_no in range(1, args.rounds + 1):
        for c in args.concurrency:
            for mode in order:
                sample = await measure(modes[mode], c, args.max_tokens)
                samples[mode][c].append(sample)
                print(f"round {round_no} {mode:>7} x{c:<3} {sample['tokens']:>5.0f} tok in {sample['seconds']:6.2f}s = {sample['tok_s']:7.1f} tok/s", flush=True)
        order.reverse()  # alternate which mode goes first, so neither always runs on a warmer machine
    return samples


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    load_at_start = os.getloadavg()
    engine = HFEngine(model_id=DEFAULT_MODEL_ID, device=args.device, max_batch_size=max(32, max(args.concurrency)),
                      cache_dir=default_cache_dir(os.environ))  # the converted checkpoint `tollgate serve` uses
    await engine.start()
    try:
        with tempfile.TemporaryDirectory(prefix="tollgate-bench-") as tmp:
            db_url = f"sqlite:///{Path(tmp) / 'tollgate.db'}"
            secret = secrets.token_urlsafe(32)
            key = await customer_key(db_url, secret)
            settings = Settings(database_url=db_url, server_secret=secret, data_dir=Path(tmp))
            with ServerThread(create_app(settings, engines={engine.model_id: engine})) as server:
                base_url = f"http://127.0.0.1:{server.port}/v1"
                async with AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600) as client:
                    modes = {"direct": direct_streamer(engine), "gateway": gateway_streamer(client, engine.model_id)}
                    for stream in modes.values():  # warm-up: first-call costs (HTTP pool, key lookup, kernels)
                        await measure(stream, max(args.concurrency), 8)
                    samples = await run_rounds(modes, args)
    finally:
        await engine.stop()
    rows = summarize(samples, args.concurrency)
    return {
        "model": engine.model_id,
        "device": args.device,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "loadavg_at_start": load_at_start,  # other work on the machine skews every number
        "summary": rows,
        "checks": run_checks(rows),
        "samples": {m: {str(c): s for c, s in by_c.items()} for m, by_c in samples.items()},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.concurrency = sorted(set(args.concurrency))
    logging.basicConfig(level=logging.WARNING)
    result = asyncio.run(run_bench(args))
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
