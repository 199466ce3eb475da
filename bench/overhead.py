"""What the gateway adds on top of the engine: mock-direct vs Tollgate vs LiteLLM's proxy, one run.

Starts the fast mock upstream (bench/mock_upstream.py), Tollgate as in production (`tollgate
serve`: API key auth, Redis quotas with limits set on the key, Postgres ledger, metrics on) and
LiteLLM's proxy from PyPI (`litellm[proxy]` at the pinned LITELLM_VERSION, 127.0.0.1, no database,
a master key) in front of the same mock, with as many worker processes as Tollgate (`--workers N`
runs both with N). LiteLLM lives in its own virtualenv (.venv-litellm/, made or moved to the pin
on first use) so its dependencies never touch the project's; its version is read from there into
the JSON. The same load generator drives all three: wrk with bench/wrk/openai.lua
(bench/loadgen.py when wrk is missing), non-streaming and streaming, at 1 and 64 connections,
targets interleaved within each round.

Prints, per cell, the medians over rounds of req/s, p50 and p99, the worst round's p99 (absolute:
never a difference with direct's p99, which is noisy), and the p50 added over direct paired by
round (median and worst round); the Tollgate/LiteLLM ratios (medians, and the worse round) only
when both ran with the same number of workers; checks that every request Tollgate answered 2xx
has its ledger row, and writes JSON. Verdicts as issue 7 sets its targets, each on the worse
round: req/s >= 20x LiteLLM's under load (cells with more than one connection), added p50 <= 1 ms
at one connection, and p99 <= 3 ms added judged as Tollgate's worst p99 minus direct's best (the
one-connection ratios are printed too). docs/performance.md, "The targets". `--from-json PATH`
prints that report from the rounds a run recorded, measuring nothing.

    python bench/overhead.py --rounds 3 --seconds 5
    python bench/overhead.py --rounds 1 --seconds 3 --no-litellm --profile 15   # py-spy raw stacks
    python bench/overhead.py --from-json docs/results/overhead-2026-12-01-s8-w1.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, contextmanager
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import loadgen  # noqa: E402
from bench.harness import REDIS, ROOT, delete_redis_keys, free_port, fresh_database, gateway, make_key, mock_upstream, process, wait_http  # noqa: E402

LIMITS = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6, "monthly_tokens": 10**14, "monthly_spend": "1000000"}
LITELLM_VENV = ROOT / ".venv-litellm"
LUA = ROOT / "bench" / "wrk" / "openai.lua"
TARGETS = ("direct", "tollgate", "litellm")
MODES = ("nonstream", "stream")
PATH = "/v1/chat/completions"


def body(stream: bool) -> bytes:
    req: dict[str, Any] = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    if stream:
        req["stream"] = True
    return json.dumps(req, separators=(",", ":")).encode()


# ---------------------------------------------------------------- LiteLLM in its own virtualenv

# The LiteLLM every figure is measured against: pinned, so that two runs compare the same proxy, and
# recorded in the JSON (settings.litellm_version, read from the virtualenv, not assumed).
LITELLM_VERSION = "1.106.12"  # later releases tried here (1.108.14, 1.110.2) ask for litellm-proxy packages the index lacks
LITELLM_REQUIREMENT = f"litellm[proxy]=={LITELLM_VERSION}"


def installed_litellm_version() -> str | None:
    """The litellm version installed in .venv-litellm/ (None: not installed)."""
    python = LITELLM_VENV / "bin" / "python"
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                           capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 and probe.stdout.strip() else None


def ensure_litellm() -> Path:
    """.venv-litellm/ with exactly the pinned litellm[proxy] (made, or moved to the pin, on first use)."""
    exe = LITELLM_VENV / "bin" / "litellm"
    found = installed_litellm_version()
    if exe.exists() and found == LITELLM_VERSION:
        return exe
    python = getattr(sys, "_base_executable", None) or shutil.which("python3") or "python3"
    doing = f"replacing litellm {found} with {LITELLM_VERSION}" if found else f"installing {LITELLM_REQUIREMENT}"
    print(f"{LITELLM_VENV}: {doing} (a few minutes)...", flush=True)
    try:
        if not (LITELLM_VENV / "bin" / "pip").exists():
            subprocess.run([python, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", LITELLM_REQUIREMENT], check=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        raise SystemExit(
            f"could not install LiteLLM into {LITELLM_VENV} ({exc}).\n"
            f"Install it by hand: python3 -m venv {LITELLM_VENV} && {LITELLM_VENV}/bin/pip install '{LITELLM_REQUIREMENT}'\n"
            "or run with --no-litellm."
        ) from None
    found = installed_litellm_version()
    if not exe.exists() or found != LITELLM_VERSION:
        raise SystemExit(f"{LITELLM_VENV} holds litellm {found}, not {LITELLM_VERSION}, after installing it; run with --no-litellm")
    return exe


def litellm_args(exe: Path, config: Path, port: int, workers: int) -> list[str]:
    """LiteLLM's proxy with as many worker processes as Tollgate gets (`--workers`): the ratios
    compare like with like."""
    return [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", str(workers)]


@contextmanager
def litellm_proxy(upstream: str, workers: int = 1) -> Iterator[tuple[str, str]]:
    exe = ensure_litellm()
    tmp = Path(tempfile.mkdtemp(prefix="litellm-bench-"))
    port = free_port()
    master = "sk-litellm-master-" + uuid.uuid4().hex
    config = tmp / "config.yaml"
    config.write_text(
        "model_list:\n  - model_name: mock\n    litellm_params:\n      model: openai/mock\n"
        f"      api_base: {upstream}\n      api_key: sk-mock\n"
        f"general_settings:\n  master_key: {master}\n"
        "litellm_settings:\n  telemetry: false\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "VIRTUAL_ENV")}
    env.update(LITELLM_TELEMETRY="False", LITELLM_LOG="ERROR", PATH=f"{LITELLM_VENV / 'bin'}:{env.get('PATH', '')}")
    with process(litellm_args(exe, config, port, workers), env, tmp / "litellm.log") as proc:
        try:
            wait_http(f"http://127.0.0.1:{port}/health/liveliness", proc, timeout=300)
        except RuntimeError:
            print((tmp / "litellm.log").read_text()[-3000:], file=sys.stderr)
            raise
        yield f"http://127.0.0.1:{port}", master


@contextmanager
def snapshot(rev: str) -> Iterator[Path]:
    """The tree of a git revision in a temporary directory (imported ahead of the editable install).
    A directory instead of a revision is used as it is: an unpacked `git archive`, where no git
    history is at hand (the device machine gets the working tree without .git)."""
    if Path(rev).is_dir():
        yield Path(rev).resolve()
        return
    with tempfile.TemporaryDirectory(prefix="tollgate-rev-") as tmp:
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp)


def pythonpath_of(stack: ExitStack, rev: str) -> str:
    """PYTHONPATH for a gateway run from `rev`'s tree (`snapshot`, closed with `stack`): that tree
    ahead of what PYTHONPATH holds already (the device's wheels), so it is the one imported."""
    return os.pathsep.join(filter(None, [str(stack.enter_context(snapshot(rev))), os.environ.get("PYTHONPATH")]))


def tollgate_as_in_production(stack: ExitStack, upstream: str, env: dict[str, str], rev: str | None = None) -> tuple[str, str, str]:
    """`tollgate serve` in front of `upstream` as this bench runs it: a fresh Postgres database for
    its ledger, Redis quotas under a prefix of its own (deleted when `stack` closes), a key with
    limits set and a price on the model (every row has a cost); `rev`: a git revision's code
    instead of the working tree. Returns (database URL, base URL, key)."""
    db = stack.enter_context(fresh_database())
    prefix = f"tgbench:o:{uuid.uuid4().hex[:6]}:"
    stack.callback(delete_redis_keys, prefix)
    tg_env = {"REDIS_URL": REDIS, "TOLLGATE_REDIS_PREFIX": prefix, **env}
    if rev:
        tg_env["PYTHONPATH"] = pythonpath_of(stack, rev)
    base, admin = stack.enter_context(gateway(db, upstream, extra_env=tg_env))
    key = make_key(base, admin, limits=LIMITS)
    httpx.post(f"{base}/admin/prices", headers={"Authorization": f"Bearer {admin}"},
               json={"model": "mock", "input_per_million": "0.150", "output_per_million": "0.600"}).raise_for_status()
    return db, base, key


# ---------------------------------------------------------------- load generation

def drive(base: str, key: str | None, stream: bool, connections: int, seconds: int) -> dict[str, Any]:
    """One load run; returns rps, p50/p99 (ms), ok (2xx) and non-2xx counts."""
    url = base.rstrip("/") + PATH
    if shutil.which("wrk"):
        env = dict(os.environ, WRK_BODY=body(stream).decode(), WRK_KEY=key or "")
        for attempt in (1, 2):  # a target that refused one run's connections (LiteLLM once did) gets a second
            run = subprocess.run(
                ["wrk", "-t", "1", "-c", str(connections), "-d", f"{seconds}s", "--timeout", "30s", "-s", str(LUA), url],
                env=env, capture_output=True, text=True,
            )
            if run.returncode == 0:
                break
            print(f"wrk against {url} exited {run.returncode}: {(run.stderr or run.stdout).strip()[-300:]}", flush=True)
            if attempt == 2:
                raise SystemExit(f"wrk failed twice against {url}")
            time.sleep(2.0)
        out = run.stdout
        line = next(x for x in out.splitlines() if x.startswith("WRK_JSON "))
        w = json.loads(line[len("WRK_JSON "):])
        errors = w["connect_errors"] + w["read_errors"] + w["write_errors"] + w["timeouts"]
        return {"rps": w["requests"] / (w["duration_us"] / 1e6), "p50_ms": w["p50_us"] / 1e3, "p99_ms": w["p99_us"] / 1e3,
                "requests": w["requests"], "ok": w["requests"] - w["non2xx"], "non2xx": w["non2xx"], "socket_errors": errors,
                "generator": "wrk"}
    u = urlparse(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    request = loadgen.build_request(host, port, u.path, body(stream), {"authorization": f"Bearer {key}"} if key else {})
    r = asyncio.run(loadgen.run(host, port, request, connections, float(seconds)))
    ok = sum(n for s, n in r.statuses.items() if 200 <= s < 300)
    return {"rps": r.rps, "p50_ms": r.p50 * 1e3, "p99_ms": r.pct(0.99) * 1e3, "requests": len(r.latencies), "ok": ok,
            "non2xx": len(r.latencies) - ok, "socket_errors": 0, "generator": "bench/loadgen.py"}


# ---------------------------------------------------------------- ledger check and profile

async def _ledger_counts(database_url: str) -> tuple[int, int]:
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT count(*) AS n, count(*) FILTER (WHERE status = 'completed') AS c FROM ledger_entries")
        return int(row["n"]), int(row["c"])
    finally:
        await conn.close()


def settled_ledger_counts(database_url: str, timeout: float = 60.0) -> tuple[int, int]:
    """Row counts once the writer has flushed: the same count twice, a second apart."""
    deadline, last = time.monotonic() + timeout, (-1, -1)
    while time.monotonic() < deadline:
        now = asyncio.run(_ledger_counts(database_url))
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    return last


def listening_pid(port: int) -> int:
    import psutil

    for c in psutil.net_connections(kind="tcp"):
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            return int(c.pid)
    raise RuntimeError(f"no process listens on port {port}")


def gateway_root(pid: int) -> psutil.Process:
    """The `tollgate serve` process at the top (with --workers, the supervisor of the listening workers)."""
    proc = psutil.Process(pid)
    while (parent := proc.parent()) is not None and "serve" in parent.cmdline() and any("tollgate" in a for a in parent.cmdline()):
        proc = parent
    return proc


def wait_idle(root: psutil.Process, timeout: float = 180.0) -> None:
    """Until the gateway's processes use under 5% of a CPU over a second."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = tree_cpu_seconds(root)
        time.sleep(1.0)
        if tree_cpu_seconds(root) - before < 0.05:
            return
    print("warning: the gateway never went idle before the load", flush=True)


def tree_cpu_seconds(root: psutil.Process) -> float:
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def profile(base: str, key: str, stream: bool, connections: int, seconds: int, out: Path) -> dict[str, Any]:
    """py-spy (raw/collapsed stacks) on the Tollgate process while the load generator drives it."""
    pid = gateway_root(listening_pid(urlparse(base).port or 80)).pid
    spy = ROOT / ".venv" / "bin" / "py-spy"
    # --nonblocking (default) samples without pausing the process: cheap, but stacks read while the
    # interpreter runs are sometimes torn (frames credited to the wrong caller). TOLLGATE_PROFILE_BLOCKING=1
    # pauses it per sample: slower under the profiler, exact stacks.
    blocking = os.environ.get("TOLLGATE_PROFILE_BLOCKING") == "1"
    rec = subprocess.Popen([str(spy), "record", "--format", "raw", "--rate", "250", *([] if blocking else ["--nonblocking"]), "--subprocesses",
                            "-d", str(seconds + 1), "-p", str(pid), "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)
    result = drive(base, key, stream, connections, seconds)
    rec.wait(timeout=seconds + 60)
    return result


def summarize_profile(raw: Path, top: int = 25) -> dict[str, Any]:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    selfs: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = [_short(f) for f in stack.split(";")]
        frames = [f for f in frames if f]
        total += count
        if frames:
            selfs[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
    def share(c: collections.Counter[str], only_ours: bool) -> list[tuple[str, float]]:
        items = [(f, n / total * 100) for f, n in c.most_common() if not only_ours or _ours(f)]
        return items[:top]
    return {"samples": total, "self": share(selfs, False), "self_ours": share(selfs, True),
            "inclusive_ours": share(incl, True)}


def _short(frame: str) -> str:
    # "fn (/path/to/pkg/mod.py:123)" -> "fn (pkg/mod.py)"; the idle "process" roots stay as they are
    name, _, loc = frame.partition(" (")
    loc = loc.rstrip(")").rsplit(":", 1)[0]
    for marker in ("/site-packages/", str(ROOT) + "/", "/lib/python3.11/"):
        if marker in loc:
            loc = loc.split(marker, 1)[1]
            break
    if "/tollgate-rev-" in loc:  # a --rev snapshot
        loc = loc.split("/tollgate-rev-", 1)[1].partition("/")[2]
    return f"{name} ({loc})" if loc else name


def _ours(frame: str) -> bool:
    return any(f"({p}/" in frame for p in ("gateway", "engines", "billing"))


# ---------------------------------------------------------------- the run

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", default="1,64", help="comma-separated connection counts")
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (direct and Tollgate only)")
    parser.add_argument("--profile", type=int, default=0, metavar="S",
                        help="after the rounds, py-spy Tollgate for S seconds per mode at the largest connection count")
    parser.add_argument("--rev", help="run Tollgate from this git revision (a `git archive` snapshot) instead of "
                        "the working tree, e.g. HEAD while uncommitted edits are in progress")
    parser.add_argument("--workers", type=int, default=1, help="Tollgate server processes (tollgate serve --workers)")
    parser.add_argument("--json", default="bench/results/overhead.json")
    parser.add_argument("--from-json", metavar="PATH", help="measure nothing: print the summary of the runs recorded in "
                        "PATH (a JSON this bench wrote) as this version of the bench summarizes them")
    args = parser.parse_args()
    if args.from_json:
        report_from_json(Path(args.from_json))
        return
    conns = [int(c) for c in args.connections.split(",")]
    targets = [t for t in TARGETS if not (args.no_litellm and t == "litellm")]
    if not shutil.which("wrk"):
        print("wrk not found (apt-get install -y wrk); falling back to bench/loadgen.py", flush=True)

    ok_total = {"tollgate": 0, "requests": 0, "connections": 0}
    runs: dict[str, dict[str, dict[int, list[dict[str, Any]]]]] = {
        t: {m: {c: [] for c in conns} for m in MODES} for t in targets}
    profiles: dict[str, Any] = {}
    with ExitStack() as stack:
        upstream = stack.enter_context(mock_upstream())
        db, tg_base, tg_key = tollgate_as_in_production(stack, upstream, {"TOLLGATE_WORKERS": str(args.workers)}, args.rev)
        bases: dict[str, tuple[str, str | None]] = {"direct": (upstream.rsplit("/v1", 1)[0], None), "tollgate": (tg_base, tg_key)}
        if "litellm" in targets:
            bases["litellm"] = stack.enter_context(litellm_proxy(upstream, workers=args.workers))

        tg_process = gateway_root(listening_pid(urlparse(tg_base).port or 80))
        wait_idle(tg_process)  # models still loading in the background (embeddings) would eat the first cells

        def run_one(target: str, stream: bool, c: int, seconds: int) -> dict[str, Any]:
            base, key = bases[target]
            before = tree_cpu_seconds(tg_process)
            r = drive(base, key, stream, c, seconds)
            if target == "tollgate":
                # CPU the gateway's processes spent per request served: steadier than req/s on a noisy
                # machine (what it costs, not what the scheduler let it have).
                spent = tree_cpu_seconds(tg_process) - before
                r["cpu_us_per_request"] = spent / max(r["requests"], 1) * 1e6
                ok_total["tollgate"] += r["ok"]
                ok_total["requests"] += r["requests"]
                ok_total["connections"] += c
            return r

        for target in targets:  # warm up every path once
            for mode in MODES:
                run_one(target, mode == "stream", max(conns), 1)
        for i in range(args.rounds):
            for mode in MODES:
                for c in conns:
                    order = targets if i % 2 == 0 else list(reversed(targets))
                    for target in order:
                        r = run_one(target, mode == "stream", c, args.seconds)
                        runs[target][mode][c].append(r)
                        cpu = f"  cpu {r['cpu_us_per_request']:6.0f} us/req" if "cpu_us_per_request" in r else ""
                        print(f"round {i + 1} {mode:9} c={c:<3} {target:8}: {r['rps']:9.0f} req/s  p50 {r['p50_ms']:8.2f} ms  "
                              f"p99 {r['p99_ms']:8.2f} ms  non-2xx {r['non2xx']}  socket errors {r['socket_errors']}{cpu}", flush=True)
        if args.profile:
            out_dir = ROOT / "bench" / "results"
            out_dir.mkdir(parents=True, exist_ok=True)
            for mode in MODES:
                raw = out_dir / f"overhead-profile-{mode}.txt"
                r = profile(tg_base, tg_key, mode == "stream", max(conns), args.profile, raw)
                ok_total["tollgate"] += r["ok"]
                ok_total["requests"] += r["requests"]
                ok_total["connections"] += max(conns)
                profiles[mode] = {"raw": str(raw.relative_to(ROOT)), "rps_under_profiler": r["rps"], **summarize_profile(raw)}
        rows, completed = settled_ledger_counts(db)

    settings = {"rounds": args.rounds, "seconds": args.seconds, "connections": conns,
                "generator": runs["direct"][MODES[0]][conns[0]][0]["generator"], "cpus": os.cpu_count(),
                "python": platform.python_version(), "tollgate_source": args.rev or "working tree", "tollgate_workers": args.workers,
                "litellm_workers": args.workers if "litellm" in targets else None,
                "litellm_version": installed_litellm_version() if "litellm" in targets else None,
                "machine": "shared with other work (noisy)"}
    summary = summarize(runs, targets, conns, settings)
    summary["ledger"] = {
        "tollgate_2xx": ok_total["tollgate"], "ledger_rows": rows, "completed_rows": completed,
        "rows_minus_2xx": rows - ok_total["tollgate"], "in_flight_bound": ok_total["connections"],
        # wrk stops with requests in flight: the gateway still meters those, wrk doesn't count them
        "every_2xx_has_a_row": ok_total["tollgate"] <= completed and rows - ok_total["tollgate"] <= ok_total["connections"],
    }
    summary["profiles"] = profiles
    summary["runs"] = runs
    print_table(summary, targets, conns)
    for mode, p in profiles.items():
        print(f"\nprofile {mode} (c={max(conns)}, {p['samples']} samples, {p['rps_under_profiler']:.0f} req/s under py-spy) -> {p['raw']}")
        print("  self, top frames:")
        for f, s in p["self"][:12]:
            print(f"    {s:5.1f}%  {f}")
        print("  inclusive, gateway/engines/billing:")
        for f, s in p["inclusive_ours"][:15]:
            print(f"    {s:5.1f}%  {f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nwrote {args.json}")


def summarize(runs: dict[str, Any], targets: list[str], conns: list[int], settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per cell: medians over rounds of req/s, p50 and p99; the worst round's p99 (absolute, never a
    difference: direct's own p99 is noisy, and a difference with it goes tiny or negative); the
    added p50 paired by round (the target's p50 minus direct's in the same round, targets being
    interleaved within a round), its median and its worst round. Tollgate/LiteLLM ratios only when
    both ran with the same number of worker processes."""
    settings = dict(settings or {})
    out: dict[str, Any] = {"medians": {}, "settings": settings}
    for t in targets:
        for m in MODES:
            for c in conns:
                rs = runs[t][m][str(c)] if str(c) in runs[t][m] else runs[t][m][c]
                direct = runs["direct"][m][str(c)] if str(c) in runs["direct"][m] else runs["direct"][m][c]
                med = {k: statistics.median(r[k] for r in rs) for k in ("rps", "p50_ms", "p99_ms")}
                med["p99_worst_ms"] = max(r["p99_ms"] for r in rs)
                med["non2xx"] = sum(r["non2xx"] for r in rs)
                if t != "direct":
                    added = [r["p50_ms"] - d["p50_ms"] for r, d in zip(rs, direct)]
                    med["added_p50_ms"] = statistics.median(added)
                    med["added_p50_worst_ms"] = max(added)
                if all("cpu_us_per_request" in r for r in rs):
                    med["cpu_us_per_request"] = statistics.median(r["cpu_us_per_request"] for r in rs)
                out["medians"].setdefault(t, {}).setdefault(m, {})[str(c)] = med
    if "litellm" in targets and same_workers(settings):
        ratios: dict[str, Any] = {}
        for m in MODES:
            for c in conns:
                tg, ll = out["medians"]["tollgate"][m][str(c)], out["medians"]["litellm"][m][str(c)]
                tg_runs = runs["tollgate"][m][str(c)] if str(c) in runs["tollgate"][m] else runs["tollgate"][m][c]
                ll_runs = runs["litellm"][m][str(c)] if str(c) in runs["litellm"][m] else runs["litellm"][m][c]
                ratios.setdefault(m, {})[str(c)] = {
                    "rps": _div(tg["rps"], ll["rps"]),
                    # the worse round: the smallest Tollgate/LiteLLM req/s ratio of any one round
                    "rps_worst_round": min(_div(a["rps"], b["rps"]) for a, b in zip(tg_runs, ll_runs)),
                    "added_p50": _div(ll["added_p50_ms"], tg["added_p50_ms"]),
                }
        out["ratios_tollgate_over_litellm"] = ratios
    return out


def same_workers(settings: dict[str, Any]) -> bool:
    """Whether LiteLLM ran with as many worker processes as Tollgate (runs recorded before the JSON
    said so ran one LiteLLM worker)."""
    return int(settings.get("litellm_workers") or 1) == int(settings.get("tollgate_workers") or 1)


def _div(a: float, b: float) -> float:
    return a / b if b else float("inf")


def print_table(summary: dict[str, Any], targets: list[str], conns: list[int]) -> None:
    s = summary["settings"]
    litellm = ""
    if "litellm" in targets:
        litellm = f", LiteLLM {s.get('litellm_version') or '(version not recorded)'} with {s.get('litellm_workers') or 1}"
    print(f"\nmedians of {s['rounds']} rounds x {s['seconds']} s, {s['generator']}, {s['cpus']} CPUs, "
          f"worker processes: Tollgate {s['tollgate_workers']}{litellm}")
    print("p99: absolute (median of rounds, and the worst round); +p50: the target's p50 minus direct's, in the same round "
          "(median of rounds, and the worst round)")
    print(f"{'path':9} {'mode':9} {'conns':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'worst p99':>9} {'+p50 ms':>8}"
          f" {'worst +p50':>10} {'non-2xx':>7} {'cpu us/req':>10}")
    for m in MODES:
        for c in conns:
            for t in targets:
                x = summary["medians"][t][m][str(c)]
                added = ("", "") if t == "direct" else (f"{x['added_p50_ms']:8.2f}", f"{x['added_p50_worst_ms']:10.2f}")
                cpu = f"{x['cpu_us_per_request']:10.0f}" if "cpu_us_per_request" in x else ""
                print(f"{t:9} {m:9} {c:>5} {x['rps']:>9.0f} {x['p50_ms']:>8.2f} {x['p99_ms']:>8.2f} {x['p99_worst_ms']:>9.2f}"
                      f" {added[0]:>8} {added[1]:>10} {x['non2xx']:>7} {cpu:>10}")
    if "ratios_tollgate_over_litellm" in summary:
        # The throughput targets are against LiteLLM's throughput, which it quotes at 16 and 64
        # connections; at one connection req/s is 1/latency, and the latency targets below are the
        # targets for it (docs/performance.md, "The targets"). Both ratios are printed for every cell.
        print(f"\nTollgate / LiteLLM, both with {s['tollgate_workers']} worker process(es) (req/s ratio of the medians, and of "
              "the worse round; added-p50 ratio LiteLLM/Tollgate)   throughput target >= 20x req/s under load "
              "(more than one connection), judged on the worse round")
        for m in MODES:
            for c in conns:
                r = summary["ratios_tollgate_over_litellm"][m][str(c)]
                verdict = ("PASS" if r["rps_worst_round"] >= 20 else "FAIL") if c > 1 else "(one connection: latency-bound, see the latency target)"
                print(f"  {m:9} c={c:<3} req/s x{r['rps']:6.1f} (worse round x{r['rps_worst_round']:6.1f})   "
                      f"added p50 x{r['added_p50']:6.1f}   {verdict}")
    elif "litellm" in targets:
        print(f"\nno Tollgate/LiteLLM ratios: LiteLLM ran with {s.get('litellm_workers') or 1} worker process(es), Tollgate with "
              f"{s['tollgate_workers']}; they would not compare like for like")
    if 1 in conns:  # the latency targets are at one connection
        tg, d = summary["medians"]["tollgate"]["nonstream"]["1"], summary["medians"]["direct"]["nonstream"]["1"]
        best_direct_p99 = min(r["p99_ms"] for r in _cell_runs(summary, "direct", "nonstream", 1)) if summary.get("runs") else d["p99_ms"]
        p99_bound = tg["p99_worst_ms"] - best_direct_p99
        print(f"\nTollgate at c=1, non-streaming: added p50 {tg['added_p50_ms']:.2f} ms, worst round {tg['added_p50_worst_ms']:.2f} ms "
              f"(target <= 1, judged on the worst round: {'PASS' if tg['added_p50_worst_ms'] <= 1 else 'FAIL'}); "
              f"p99 Tollgate {tg['p99_worst_ms']:.2f} ms, direct {d['p99_worst_ms']:.2f} ms (absolute, worst round of each); "
              f"Tollgate's worst p99 minus direct's best {p99_bound:.2f} ms (target <= 3: {'PASS' if p99_bound <= 3 else 'FAIL'})")
    led = summary.get("ledger")
    if led:
        print(f"ledger: {led['tollgate_2xx']} Tollgate 2xx responses, {led['completed_rows']} completed rows "
              f"({led['ledger_rows']} in all; {led['rows_minus_2xx']} more rows than 2xx, in flight when the generator "
              f"stopped, bound {led['in_flight_bound']}): {'PASS' if led['every_2xx_has_a_row'] else 'FAIL'}")


def _cell_runs(summary: dict[str, Any], target: str, mode: str, c: int) -> list[dict[str, Any]]:
    cell = summary["runs"][target][mode]
    return cell[str(c)] if str(c) in cell else cell[c]


def report_from_json(path: Path) -> dict[str, Any]:
    """The summary and table this bench prints, from the per-round measurements a run (of this or an
    earlier version of the bench) recorded in its JSON: no new measurement."""
    recorded = json.loads(Path(path).read_text())
    runs, settings = recorded["runs"], dict(recorded["settings"])
    targets = [t for t in TARGETS if t in runs]
    conns = [int(c) for c in settings["connections"]]
    if "litellm" in targets:
        settings.setdefault("litellm_workers", 1)  # before the JSON recorded it, LiteLLM always ran one worker
        settings.setdefault("litellm_version", None)
    summary = summarize(runs, targets, conns, settings)
    summary["ledger"] = recorded.get("ledger")
    summary["runs"] = runs
    print(f"from {path} (recorded measurements)")
    print_table(summary, targets, conns)
    return summary

if __name__ == "__main__":
    main()
