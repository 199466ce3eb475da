"""Where the first token's time goes: per-hop medians through `tollgate serve` beside the engine alone.

    python bench/gpu_ttft_trace.py --model smollm2=/path/to/ckpt [--levels 16,64,256] \\
        [--variant NAME:KEY=VALUE,KEY=VALUE ...]      # more gateway variants, e.g. a setting to try

Runs what bench/gpu_gateway_vs_engine.py runs (same settings, prompts and load), with
bench/ttft_trace/sitecustomize.py loaded into the engine-alone process, the gateway and its engine
process. Each request's first token is followed through every hop on one clock
(time.perf_counter, CLOCK_MONOTONIC on Linux, shared by the processes):

    client sent -> the handler reads the body -> engine.stream() called (admission done) -> "add" sent on the
    pipe -> engine process submits it -> the batching manager schedules it (transformers' own
    stamp) -> first token out of the manager -> that step's pipe message sent -> gateway loop has
    it -> the stream yields text -> the client reads the SSE event

and the engine alone's: stream() called -> submitted -> scheduled -> first token -> yielded.
Printed per level: the median (p50) and p90 of each hop in ms, the burst's spread (how long the
first wave of `level` requests takes to reach the engine, first to last), and how many prefill
steps the first wave was scheduled over. On a GPU host: carry bench/wheels and run it as
bench/gpu_gateway_vs_engine.sh runs the comparison (PYTHONPATH with the wheels' site folder).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import gpu_gateway_vs_engine as g  # noqa: E402

TRACE_DIR = ROOT / "bench" / "ttft_trace"


def key_of(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids[:12])


def levels_of(args: argparse.Namespace, vocab: int) -> dict[str, int]:
    """Each request's level, by its prompt's first ids (the bench's prompts are seeded by level)."""
    return {key_of(ids): level for level in args.levels for ids in g.prompts(g.requests_at(level), args.isl, vocab, seed=level)}


def read_events(folder: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(folder.glob("trace-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return events


def pct(values: list[float], q: float) -> float | None:
    return g.pct(values, q)


def hops_engine(events: list[dict[str, Any]], level_of: dict[str, int]) -> dict[int, dict[str, list[float]]]:
    by_rid: dict[str, dict[str, Any]] = {}
    for e in events:
        if "rid" in e:
            by_rid.setdefault(e["rid"], {})[e["ev"]] = e
    out: dict[int, dict[str, list[float]]] = {}
    for rid, ev in by_rid.items():
        s = ev.get("g_stream")
        if s is None or s["key"] not in level_of or not all(k in ev for k in ("c_add", "c_out", "g_yield")):
            continue
        level = level_of[s["key"]]
        row = out.setdefault(level, {})
        sched = ev["c_out"]["sched"]
        for name, value in (("stream->submitted", ev["c_add"]["t"] - s["t"]), ("submitted->scheduled", sched - ev["c_add"]["t"]),
                            ("scheduled->first token", ev["c_out"]["t"] - sched), ("first token->yield", ev["g_yield"]["t"] - ev["c_out"]["t"]),
                            ("TOTAL (stream->yield)", ev["g_yield"]["t"] - s["t"])):
            row.setdefault(name, []).append(value * 1000)
        row.setdefault("_submit", []).append(ev["c_add"]["t"])
        row.setdefault("_sched", []).append(sched)
    return out


def hops_gateway(events: list[dict[str, Any]], clients: dict[str, tuple[float, float | None]], level_of: dict[str, int]) -> dict[int, dict[str, list[float]]]:
    by_rid: dict[str, dict[str, Any]] = {}
    for e in events:
        if "rid" in e:
            by_rid.setdefault(e["rid"], {})[e["ev"]] = e
    out: dict[int, dict[str, list[float]]] = {}
    names = ["client->handler reads body", "body->stream (admission)", "stream->add sent", "add sent->engine submits", "submitted->scheduled",
             "scheduled->first token", "first token->pipe send", "pipe send->gateway loop", "gateway loop->yield", "yield->client reads",
             "TOTAL (client TTFT)"]
    bodies = {e["key"]: e for e in events if e["ev"] == "g_body"}
    for rid, ev in by_rid.items():
        s = ev.get("g_stream")
        if s is None or s["key"] not in clients or s["key"] not in level_of:
            continue
        start, first = clients[s["key"]]
        need = ("g_add_sent", "c_add", "c_out", "c_flush", "g_put", "g_yield")
        if first is None or s["key"] not in bodies or not all(k in ev for k in need):
            continue
        sched = ev["c_out"]["sched"]
        points = [start, bodies[s["key"]]["t"], s["t"], ev["g_add_sent"]["t"], ev["c_add"]["t"], sched, ev["c_out"]["t"], ev["c_flush"]["t"],
                  ev["g_put"]["t"], ev["g_yield"]["t"], first]
        row = out.setdefault(level_of[s["key"]], {})
        for name, a, b in zip(names, points, points[1:]):
            row.setdefault(name, []).append((b - a) * 1000)
        row.setdefault(names[-1], []).append((first - start) * 1000)
        row.setdefault("_submit", []).append(ev["c_add"]["t"])
        row.setdefault("_sched", []).append(sched)
        row.setdefault("_batch", []).append(ev["c_flush"]["batch"])
    return out


def burst(row: dict[str, list[float]], level: int) -> tuple[float | None, int]:
    """The first wave: the `level` earliest submissions. Their spread (ms) and the number of distinct
    scheduling stamps among them (prefill steps it took to start them all)."""
    pairs = sorted(zip(row.get("_submit", []), row.get("_sched", [])))[:level]
    if not pairs:
        return None, 0
    return (pairs[-1][0] - pairs[0][0]) * 1000, len({round(s, 4) for _, s in pairs})


def print_table(title: str, by_level: dict[int, dict[str, list[float]]], levels: list[int]) -> None:
    print(f"\n{title}")
    names = [n for n in next(iter(by_level.values()), {}) if not n.startswith("_")]
    head = "| hop | " + " | ".join(f"{lv} p50 | {lv} p90" for lv in levels) + " |"
    print(head)
    print("|---|" + "---:|" * (2 * len(levels)))
    for name in names:
        cells = []
        for lv in levels:
            vals = by_level.get(lv, {}).get(name, [])
            cells += [g.fmt(pct(vals, 0.5), 1), g.fmt(pct(vals, 0.9), 1)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    spread = [burst(by_level.get(lv, {}), lv) for lv in levels]
    print("| first wave: submit spread ms / prefill steps | " + " | ".join(f"{g.fmt(s, 1)} | {n}" for s, n in spread) + " |")
    if any(by_level.get(lv, {}).get("_batch") for lv in levels):
        print("| streams in the first token's pipe message p50 | " + " | ".join(
            f"{g.fmt(pct([float(b) for b in by_level.get(lv, {}).get('_batch', [])], 0.5), 0)} | " for lv in levels) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "engine-alone"])
    parser.add_argument("--model", action="append", required=True, help="NAME=PATH (a checkpoint directory); repeatable")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--levels", default="16,64,256")
    parser.add_argument("--isl", type=int, default=512)
    parser.add_argument("--osl", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-queue", type=int, default=256)
    parser.add_argument("--kv-cache-tokens", type=int, default=0)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,... a gateway variant with these settings")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine-alone run")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "gpu_ttft_trace.json"))
    args = parser.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",") if x]
    args.levels_for = lambda label: args.levels
    if args.mode == "engine-alone":
        args.model_path = args.model[0].partition("=")[2]  # in its own process, with the tracer loaded (see below)
        result = asyncio.run(g.engine_alone(args))
        print(json.dumps({"vocab": result["vocab"]}))
        return 0
    reports = [trace_model(args, spec) for spec in args.model]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(reports))
    print(f"\nJSON: {args.json}")
    return 0


def trace_model(args: argparse.Namespace, spec: str) -> dict[str, Any]:
    name, _, args.model_path = spec.partition("=")
    work = Path(tempfile.mkdtemp(prefix="tollgate-ttft-trace-"))
    pythonpath = f"{TRACE_DIR}:{os.environ.get('PYTHONPATH', '')}"
    config = json.loads((Path(args.model_path) / "config.json").read_text())
    vocab = int(config["vocab_size"])
    report: dict[str, Any] = {"model": name, "levels": args.levels, "variants": {}}
    if not args.no_engine:
        folder = work / "engine"
        folder.mkdir()
        env = dict(os.environ, PYTHONPATH=pythonpath, TOLLGATE_TTFT_TRACE=str(folder))
        cmd = [sys.executable, __file__, "engine-alone", "--model", spec, "--device", args.device, "--levels", ",".join(map(str, args.levels)),
               "--isl", str(args.isl), "--osl", str(args.osl), "--batch-size", str(args.batch_size), "--max-queue", str(args.max_queue),
               "--kv-cache-tokens", str(args.kv_cache_tokens), "--max-batch-tokens", str(args.max_batch_tokens)]
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, check=True)
        vocab = json.loads(out.stdout.decode().strip().splitlines()[-1])["vocab"]
    level_of = levels_of(args, vocab)
    if not args.no_engine:
        engine = hops_engine(read_events(folder), level_of)
        report["variants"]["engine"] = {str(k): v for k, v in engine.items()}
        print_table(f"{name}: the engine alone (HFEngine in its own process, all of a level's requests in one loop turn)", engine, args.levels)
    variants = [("gateway", {})]
    for spec in args.variant:
        label, _, pairs = spec.partition(":")
        variants.append((label, dict(p.split("=", 1) for p in pairs.split(",") if p)))
    for label, extra in variants:
        folder = work / label
        folder.mkdir()
        clients: dict[str, tuple[float, float | None]] = {}
        plain = g.sse_request

        async def recorded(port: int, key: str, ids: list[int], osl: int) -> Any:
            t = await plain(port, key, ids, osl)
            clients[key_of(ids)] = (t.start, t.first)
            return t

        g.sse_request = recorded
        try:
            result = g.through_gateway(args, args.model_path, vocab, "gateway", {**extra, "PYTHONPATH": pythonpath, "TOLLGATE_TTFT_TRACE": str(folder)})
        finally:
            g.sse_request = plain
        hops = hops_gateway(read_events(folder), clients, level_of)
        report["variants"][label] = {"settings": extra, "cells": result["cells"], "hops": {str(k): v for k, v in hops.items()}}
        print_table(f"{name}: through tollgate serve, {label} {extra or ''}", hops, args.levels)
        print("| tok/s | " + " | ".join(f"{result['cells'][str(lv)]['tok_s']} | " for lv in args.levels) + " |")
    return report


if __name__ == "__main__":
    sys.exit(main())
