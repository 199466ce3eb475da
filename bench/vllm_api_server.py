"""vLLM's OpenAI API server relaying streams from a model-less load, for comparison with the gateway's
relay capacity (docs/performance.md, "Relay capacity"): streamed tokens/s and the API server process's
CPU per 1,000 tokens, beside its engine core's.

The load: vLLM (.venv-vllm, `make vllm`) serving a one-layer, 64-wide copy of the embedded SmolLM2's
config with `--load-format dummy` (random weights, the real 49k tokenizer), so the engine core's step
is cheap and the API server's work (detokenizing, SSE) is what is measured. Start it, then run this:

    .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model DIR --load-format dummy \\
        --served-model-name tiny --port 18931 --max-model-len 512 --max-num-seqs 256 --dtype float32 --enforce-eager
    .venv/bin/python bench/vllm_api_server.py --url http://127.0.0.1:18931 --pid <API server pid> --streams 64 256

`--make-model DIR` writes DIR (the config and tokenizer files; no weights) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import psutil


def make_model(target: Path) -> None:
    from engines.backends.hf import bundled_gguf_path, converted_dir
    from gateway.config import default_cache_dir

    source = converted_dir(bundled_gguf_path(), default_cache_dir(os.environ))
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(source / name, target / name)
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    config.pop("head_dim", None)
    (target / "config.json").write_text(json.dumps(config, indent=1))


async def one(client: httpx.AsyncClient, max_tokens: int) -> tuple[int, int]:
    """(usage's completion tokens, SSE events that carried text) of one streamed completion."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = events = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith('data: {"id"') and '"text":"' in line and '"text":""' not in line:
                events += 1
            if line.startswith("data: {") and '"usage":{' in line:
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens, events


def cpu(process: psutil.Process) -> float:
    t = process.cpu_times()
    return t.user + t.system


async def run(url: str, server: psutil.Process, streams: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    engine = [p for p in server.children(recursive=True)]
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        await asyncio.gather(*(one(client, 16) for _ in range(min(streams, 16))))  # warm
        results = []
        for _ in range(rounds):
            api0, eng0, began = cpu(server), sum(cpu(p) for p in engine), time.perf_counter()
            answers = await asyncio.gather(*(one(client, max_tokens) for _ in range(streams)))
            tokens, events = sum(t for t, _ in answers), sum(e for _, e in answers)
            wall = time.perf_counter() - began
            api, eng = cpu(server) - api0, sum(cpu(p) for p in engine) - eng0
            results.append({"tokens": tokens, "tokens_per_event": round(tokens / max(1, events), 2), "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall),
                            "api_server_cpu_ms_per_1k": round(api * 1e6 / tokens, 1), "engine_cpu_ms_per_1k": round(eng * 1e6 / tokens, 1)})
    return {"streams": streams, "max_tokens": max_tokens, "rounds": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make-model", type=Path)
    parser.add_argument("--url", default="http://127.0.0.1:18931")
    parser.add_argument("--pid", type=int, help="the API server's pid (`vllm ... api_server`); its children are the engine core")
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.make_model:
        make_model(args.make_model)
        return
    server = psutil.Process(args.pid)
    for streams in args.streams:
        print(json.dumps(asyncio.run(run(args.url, server, streams, args.max_tokens, args.rounds))), flush=True)


if __name__ == "__main__":
    main()
