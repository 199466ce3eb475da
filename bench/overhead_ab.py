"""Two (or more) gateways side by side, one run: what a change does to the gateway's own cost.

Each variant is a `tollgate serve` set up as bench/overhead.py sets it up (its
`tollgate_as_in_production`: API key auth, Redis quotas with limits, a priced model, Postgres
ledger with its journal, metrics on) in front of the same mock
upstream; all of them run at once and the load generator (wrk, bench/loadgen.py without it) drives
them in turn, cell by cell, the order reversed every other round. On a machine whose speed drifts
by 10-20% over minutes, that interleaving is what makes differences of a few percent visible:
two separate bench/overhead.py runs minutes apart cannot show them.

`--together` goes further: every variant is driven at the same time, each by a load generator
process of its own with the cell's connection count, and each one's CPU is read over the same
seconds; the machine's drift, and whatever else runs on it, then weighs on all of them alike. The
machine is busier than with one gateway at a time (absolute CPU per request and req/s are not
comparable with an interleaved run's), but the ratios are like for like. Each cell also prints the
median of the per-round CPU ratios (paired within a round) beside the ratio of the medians.

A variant is a source and optional environment: `wt` (the working tree) or any git revision
(`HEAD~1`, a commit), then `+NAME=VALUE;NAME=VALUE` for settings:

    python bench/overhead_ab.py HEAD~1 wt                                 # before/after a commit
    python bench/overhead_ab.py wt 'wt+TOLLGATE_LEDGER_LINGER_MS=200'     # a setting
    python bench/overhead_ab.py cc00ac0 wt --connections 1 --rounds 5
    python bench/overhead_ab.py a8e8107 HEAD --together --rounds 9
    python bench/overhead_ab.py a8e8107 'a8e8107+' HEAD --together --json run1.json  # the first twice: A/A
    python bench/overhead_ab.py --pool run1.json run2.json run3.json      # the rounds of saved runs, pooled
                                    # (the same variants, in any order after the same first one)

Prints, per cell (mode x connections), each variant's medians over rounds: req/s, p50/p99 and the
CPU its processes spent per request served, then each variant's CPU and req/s against the first:
the ratio of the medians, and the median of the per-round ratios with their quartiles. The first
variant named twice (`REV` and `REV+`, the same code in two gateways) measures the noise floor:
what the ratios say when nothing differs; each other variant is then also set against the mean of
those two in each round (a steadier baseline than either alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import mock_upstream  # noqa: E402
from bench.overhead import body, drive, gateway_root, listening_pid, tollgate_as_in_production, tree_cpu_seconds, wait_idle  # noqa: E402


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


def drive_together(targets: dict[str, tuple[str, str, Any]], stream: bool, connections: int, seconds: int) -> dict[str, dict[str, Any]]:
    """Drives every target at once, each from a load generator process of its own (started, then
    released together), and reads each target's CPU over the same interval."""
    procs = {}
    for spec, (base, key, _root) in targets.items():
        procs[spec] = subprocess.Popen(
            [sys.executable, __file__, "--drive-one", base, key, "1" if stream else "0", str(connections), str(seconds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
    for p in procs.values():  # each says it is ready: imports done, nothing sent yet
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    before = {spec: tree_cpu_seconds(root) for spec, (_b, _k, root) in targets.items()}
    for p in procs.values():
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = {}
    for spec, p in procs.items():
        out, _ = p.communicate(timeout=seconds + 120)
        if p.returncode != 0:
            raise SystemExit(f"the load generator for {spec} exited {p.returncode}")
        results[spec] = json.loads(out.strip().splitlines()[-1])
    for spec, (_b, _k, root) in targets.items():
        results[spec]["cpu_us_per_request"] = (tree_cpu_seconds(root) - before[spec]) / max(results[spec]["requests"], 1) * 1e6
    return results


def drive_one(base: str, key: str, stream: bool, connections: int, seconds: int) -> None:
    """The child side of drive_together: bench/loadgen.py against one target, once told to go."""
    import asyncio

    from bench import loadgen
    from bench.overhead import PATH

    url = urlparse(base.rstrip("/") + PATH)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    request = loadgen.build_request(host, port, url.path, body(stream), {"authorization": f"Bearer {key}"})
    print("ready", flush=True)
    sys.stdin.readline()
    r = asyncio.run(loadgen.run(host, port, request, connections, float(seconds)))
    ok = sum(n for s, n in r.statuses.items() if 200 <= s < 300)
    print(json.dumps({"rps": r.rps, "p50_ms": r.p50 * 1e3, "p99_ms": r.pct(0.99) * 1e3, "requests": len(r.latencies), "ok": ok,
                      "non2xx": len(r.latencies) - ok, "generator": "bench/loadgen.py (together)"}), flush=True)


def main() -> None:
    if len(sys.argv) == 7 and sys.argv[1] == "--drive-one":
        _, _, base, key, stream, connections, seconds = sys.argv
        drive_one(base, key, stream == "1", int(connections), int(seconds))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", help="wt, a git revision, each optionally +NAME=VALUE;...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--connections", default="1,64", help="comma-separated connection counts")
    parser.add_argument("--modes", default="nonstream,stream")
    parser.add_argument("--together", action="store_true", help="drive all variants at once (CPU read over the same seconds)")
    parser.add_argument("--json", help="also write the per-round figures here")
    parser.add_argument("--pool", nargs="+", metavar="JSON", help="drive nothing: the report over these saved runs' rounds")
    args = parser.parse_args()
    if args.pool:
        pool(args.pool)
        return
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
                if args.together:
                    for spec, result in drive_together(gateways, stream, c, args.seconds).items():
                        runs.setdefault(f"{'stream' if stream else 'nonstream'} c={c}|{spec}", []).append(result)
                    continue
                order = list(gateways) if r % 2 == 0 else list(reversed(gateways))
                for spec in order:
                    base, key, root = gateways[spec]
                    before = tree_cpu_seconds(root)
                    result = drive(base, key, stream, c, args.seconds)
                    result["cpu_us_per_request"] = (tree_cpu_seconds(root) - before) / max(result["requests"], 1) * 1e6
                    runs.setdefault(f"{'stream' if stream else 'nonstream'} c={c}|{spec}", []).append(result)

    if args.json:
        Path(args.json).write_text(json.dumps({"variants": args.variants, "together": args.together, "runs": runs}, indent=1))
    report(args.variants, cells, runs, f"{args.rounds} rounds x {args.seconds} s, variants {'driven together' if args.together else 'interleaved'}")


def paired(ratios: list[float]) -> str:
    """Per-round ratios as their median and quartiles (min and max below four rounds)."""
    lo, hi = (min(ratios), max(ratios)) if len(ratios) < 4 else statistics.quantiles(ratios, n=4)[::2]
    return f"paired x {statistics.median(ratios):.3f} [{lo:.3f}-{hi:.3f}]"


def report(variants: list[str], cells: list[tuple[bool, int]], runs: dict[str, list[dict[str, Any]]], what: str) -> None:
    """Per cell, each variant's medians over rounds, then its CPU against the first variant's: the
    ratio of the medians, and the median (with quartiles) of the per-round ratios."""
    width = max(len(v) for v in variants)
    controls = [v for v in variants if parse_variant(v) == parse_variant(variants[0])]  # the same code as the first
    print(f"medians of {what}")
    for stream, c in cells:
        cell = f"{'stream' if stream else 'nonstream'} c={c}"
        first: dict[str, float] = {}
        base_rounds = runs[f"{cell}|{variants[0]}"]
        for spec in variants:
            rs = runs[f"{cell}|{spec}"]
            med = {k: statistics.median(x[k] for x in rs) for k in ("rps", "p50_ms", "p99_ms", "cpu_us_per_request")}
            first = first or med
            per_round = [x["cpu_us_per_request"] / b["cpu_us_per_request"] for x, b in zip(rs, base_rounds)]
            print(
                f"{cell:14s} {spec:{width}s}  req/s {med['rps']:7.0f}  p50 {med['p50_ms']:6.2f} ms  p99 {med['p99_ms']:6.2f} ms"
                f"  cpu {med['cpu_us_per_request']:6.0f} us/req  (cpu x {med['cpu_us_per_request'] / first['cpu_us_per_request']:.3f},"
                f" {paired(per_round)}, req/s x {med['rps'] / first['rps']:.2f})"
            )
        if len(controls) < 2:
            continue
        # the first variant named more than once: each other one against their mean, round by round
        means = [statistics.fmean(r["cpu_us_per_request"] for r in rounds) for rounds in zip(*(runs[f"{cell}|{c}"] for c in controls))]
        for spec in variants:
            if spec not in controls:
                per_round = [x["cpu_us_per_request"] / m for x, m in zip(runs[f"{cell}|{spec}"], means)]
                print(f"{cell:14s} {spec:{width}s}  against the mean of {', '.join(controls)} in each round: cpu {paired(per_round)}")


def pool(paths: list[str]) -> None:
    """The report over the rounds of several saved runs (--json) of the same variants, pooled."""
    saved = [json.loads(Path(p).read_text()) for p in paths]
    variants = saved[0]["variants"]  # runs that named them in another order pool too (the first stays the baseline)
    if any(sorted(s["variants"]) != sorted(variants) or s["variants"][0] != variants[0] for s in saved):
        raise SystemExit("--pool: the runs compare different variants, or against a different first one")
    runs: dict[str, list[dict[str, Any]]] = {}
    for s in saved:
        for name, rs in s["runs"].items():
            runs.setdefault(name, []).extend(rs)
    cells = []
    for name in runs:
        cell = name.split("|", 1)[0]
        mode, _, c = cell.partition(" c=")
        if (mode == "stream", int(c)) not in cells:
            cells.append((mode == "stream", int(c)))
    rounds = len(runs[next(iter(runs))])
    modes = {"driven together" if s.get("together") else "interleaved" for s in saved}
    report(variants, cells, runs, f"{rounds} rounds pooled from {len(paths)} runs, variants {' and '.join(sorted(modes))}")


if __name__ == "__main__":
    main()
