"""Two (or more) gateways side by side, one run: what a change does to the gateway's own cost.

Each variant is a `tollgate serve` set up as bench/overhead.py sets it up (its
`tollgate_as_in_production`: API key auth, Redis quotas with limits, a priced model, Postgres
ledger with its journal, metrics on) in front of the same mock
upstream; all of them run at once and the load generator (wrk, bench/loadgen.py without it) drives
them in turn, cell by cell, the order reversed every other round. On a machine whose speed drifts
by 10-20% over minutes, that interleaving is what makes differences of a few percent visible:
two separate bench/overhead.py runs minutes apart cannot show them.

A variant is a source and optional environment: `wt` (the working tree) or any git revision
(`HEAD~1`, a commit), then `+NAME=VALUE;NAME=VALUE` for settings:

    python bench/overhead_ab.py HEAD~1 wt                                 # before/after a commit
    python bench/overhead_ab.py wt 'wt+TOLLGATE_LEDGER_LINGER_MS=200'     # a setting
    python bench/overhead_ab.py cc00ac0 wt --connections 1 --rounds 5

Prints, per cell (mode x connections), each variant's medians over rounds: req/s, p50/p99 and the
CPU its processes spent per request served, then each variant's CPU and req/s against the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import mock_upstream  # noqa: E402
from bench.overhead import drive, gateway_root, listening_pid, tollgate_as_in_production, tree_cpu_seconds, wait_idle  # noqa: E402


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """`rev+A=1;B=2` -> (rev, {A: 1, B: 2})."""
    source, _, settings = spec.partition("+")
    env = {}
    for pair in filter(None, settings.split(";")):
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise SystemExit(f"{spec!r}: settings are NAME=VALUE pairs separated by ';'")
        env[name] = value
    return source or "wt", env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="wt, a git revision, each optionally +NAME=VALUE;...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--connections", default="1,64", help="comma-separated connection counts")
    parser.add_argument("--modes", default="nonstream,stream")
    parser.add_argument("--json", help="also write the per-round figures here")
    args = parser.parse_args()
    if len(args.variants) < 2:
        parser.error("give at least two variants to compare")
    conns = [int(c) for c in args.connections.split(",")]
    cells = [(mode == "stream", c) for mode in args.modes.split(",") for c in conns]
    runs: dict[str, list[dict[str, Any]]] = {}

    with mock_upstream() as upstream, ExitStack() as stack:
        gateways: dict[str, tuple[str, str, Any]] = {}
        for spec in args.variants:
            source, settings = parse_variant(spec)
            _db, base, key = tollgate_as_in_production(stack, upstream, settings, None if source == "wt" else source)
            gateways[spec] = (base, key, gateway_root(listening_pid(urlparse(base).port or 80)))
        for base, key, root in gateways.values():
            wait_idle(root)
            drive(base, key, False, max(conns), 1)  # warm-up
        for r in range(args.rounds):
            for stream, c in cells:
                order = list(gateways) if r % 2 == 0 else list(reversed(gateways))
                for spec in order:
                    base, key, root = gateways[spec]
                    before = tree_cpu_seconds(root)
                    result = drive(base, key, stream, c, args.seconds)
                    result["cpu_us_per_request"] = (tree_cpu_seconds(root) - before) / max(result["requests"], 1) * 1e6
                    runs.setdefault(f"{'stream' if stream else 'nonstream'} c={c}|{spec}", []).append(result)

    width = max(len(v) for v in args.variants)
    print(f"medians of {args.rounds} rounds x {args.seconds} s, variants interleaved")
    for stream, c in cells:
        cell = f"{'stream' if stream else 'nonstream'} c={c}"
        first: dict[str, float] = {}
        for spec in args.variants:
            rs = runs[f"{cell}|{spec}"]
            med = {k: statistics.median(x[k] for x in rs) for k in ("rps", "p50_ms", "p99_ms", "cpu_us_per_request")}
            first = first or med
            print(
                f"{cell:14s} {spec:{width}s}  req/s {med['rps']:7.0f}  p50 {med['p50_ms']:6.2f} ms  p99 {med['p99_ms']:6.2f} ms"
                f"  cpu {med['cpu_us_per_request']:6.0f} us/req  (cpu x {med['cpu_us_per_request'] / first['cpu_us_per_request']:.2f},"
                f" req/s x {med['rps'] / first['rps']:.2f})"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"variants": args.variants, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
