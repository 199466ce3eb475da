"""`tollgate` command line: serve, migrate, accounts and keys. Talks to the database directly."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from alembic.script.revision import RevisionError
from alembic.util import CommandError as AlembicCommandError
from sqlalchemy.exc import SQLAlchemyError

from billing import migrate as migrations
from billing.db import async_url, create_engine
from billing.keys.store import AccountExists, KeyStore, UnknownAccount
from engines.base import EngineError
from gateway.cli import bench as cli_bench, billing as cli_billing, credits as cli_credits, ledger as cli_ledger, ops as cli_ops
from gateway.config import LOG_FORMATS, LOG_LEVELS, Settings, for_workers, load_settings, worker_settings
from gateway.cli import db_id, iso_time, port_number
from gateway.http.logs import configure_logging


def _with_keys(settings: Settings, fn: Callable[[KeyStore], Awaitable[Any]]) -> Any:
    async def run() -> Any:
        db = create_engine(settings.resolved_database_url)
        try:
            return await fn(KeyStore(db, settings.secret_bytes()))
        finally:
            await db.dispose()

    return asyncio.run(run())


def _print(payload: Any) -> None:
    print(json.dumps(payload, indent=2, default=str))


def cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    if args.downgrade and not args.revision:
        # `base` drops every table, the ledger's too: that is asked for by name, never a default.
        print("error: --downgrade needs --revision (the revision to go back to; `base` drops every table, "
              "the ledger and invoices too)", file=sys.stderr)
        return 2
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if args.downgrade:
        migrations.downgrade(settings.resolved_database_url, args.revision)
    else:
        migrations.upgrade(settings.resolved_database_url, args.revision or "head")
    print(f"migrations applied ({'downgrade' if args.downgrade else 'upgrade'} to {args.revision or 'head'})")
    return 0


def _tune_gc(settings: Settings) -> None:
    """TOLLGATE_GC_GEN0: the collector's gen-0 threshold, for operators who measure a gain. (What is
    alive once the server has started is frozen out of the collector's scans by the app itself,
    `create_app(freeze_gc=True)`, once started and again as models load.)"""
    import gc

    if settings.process.gc_gen0:
        gc.set_threshold(settings.process.gc_gen0, *gc.get_threshold()[1:])


def cmd_serve(settings: Settings, args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.http.drain import Drain, DrainingServer
    from gateway.http.hardening import guarded_http_protocol

    host = args.host or settings.http.host
    port = args.port or settings.http.port
    args.log_level = args.log_level or settings.process.log_level  # the flag, else TOLLGATE_LOG_LEVEL
    args.log_format = args.log_format or settings.process.log_format
    settings = settings.with_overrides(http={"host": host, "port": port}, engines={"models_file": args.models or settings.engines.models_file})
    if settings.engines.models_file and check_models_file(settings.engines.models_file, quiet=not args.check, environ=settings.engines.environ):
        return 2  # refuse to start on a bad models file, before anything loads
    if args.check:
        return 0
    workers = args.workers if args.workers is not None else settings.http.workers
    if workers < 1:
        print(f"error: --workers must be at least 1, got {workers}", file=sys.stderr)
        return 2
    settings = settings.with_overrides(http={"workers": workers})
    refused = workers_refused(settings) if workers > 1 else None
    if refused:
        print(f"error: --workers {workers}: {refused}", file=sys.stderr)
        return 2
    refused = _unstartable(settings)
    if refused:
        print(f"error: {refused}", file=sys.stderr)  # one line, before anything loads (it was a traceback in the log)
        return 2
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrations.upgrade(settings.resolved_database_url)
    created = _with_keys(settings, lambda keys: keys.ensure_admin_key(settings.admin_key))
    if created:
        print("=" * 72)
        print("Created the first admin key. It is shown only this once; store it now:")
        print(f"    {created}")
        print("=" * 72, flush=True)
    print(f"Tollgate serving {settings.engines.models_file or settings.engines.model_id} on http://{host}:{port}/v1", flush=True)
    configure_logging(args.log_format, args.log_level)  # JSON lines with request ids; uvicorn logs through it
    if workers > 1:
        _serve_workers(settings, args, workers)
        return 0
    http = guarded_http_protocol(read_timeout=settings.http.request_read_timeout, max_header_bytes=settings.http.max_header_bytes)
    app = create_app(settings, freeze_gc=True, exit_on_load_failure=True)
    _tune_gc(settings)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=args.log_level, loop="auto", http=http,
                                           log_config=None, access_log=False, proxy_headers=False))  # nothing reads the client address
    stop = lambda: setattr(server, "should_exit", True)  # noqa: E731  (uvicorn's graceful stop)
    app.state.stop_server = stop
    server.drain = Drain(app, settings.http.drain_seconds, stop)
    server.run()
    fatal = app.state.fatal
    if fatal:
        print(f"error: {fatal}", file=sys.stderr)
        return 1
    return 0


def _unstartable(settings: Settings) -> str | None:
    """What the server's start would fail on after the model loads, told before: a backend without a
    models file, a read-replica URL that does not parse."""
    from gateway.wiring import unserved_backend

    refused = unserved_backend(settings.engines)
    if refused or not settings.database_read_url:
        return refused
    try:
        async_url(settings.database_read_url)
    except (SQLAlchemyError, ValueError) as exc:
        return f"DATABASE_READ_URL: {_described(exc)}"
    return None


def workers_refused(settings: Settings) -> str | None:
    """Why these settings cannot run as several processes (None: they can). Quotas and the ledger
    stay exact across workers only where every worker shares them, and an in-process model would
    load once per worker."""
    if not settings.engines.models_file:
        return "several workers need remote engines (a models file of `openai` backends); the embedded model would load once per worker"
    from engines.registry import load_models

    from gateway.serving.engine_hosts import hosted

    table = load_models(settings.engines.models_file, environ=settings.engines.environ)
    local = sorted(spec.id for spec in table.specs.values() if spec.backend == "hf" and not hosted(spec))  # trtllm: always hosted
    if local:
        return (f"the models {', '.join(local)} run in-process and would load once per worker; serve them with one worker, "
                "or in an engine process the workers share: `process: true`")
    if not settings.redis.url:
        return "several workers share quotas through Redis: set REDIS_URL"
    if not settings.resolved_database_url.startswith("postgresql"):
        return "several workers write one ledger: set DATABASE_URL to Postgres (SQLite takes one writer)"
    return None


def _serve_workers(settings: Settings, args: argparse.Namespace, workers: int) -> None:
    """uvicorn's process manager: `workers` processes accept on one socket, each building its app
    from this whole Settings (`worker_app`; gateway/config.py:for_workers), restarted if one dies.
    Counters and histograms of /metrics are summed across them (prometheus_client's multiprocess mode)."""
    import shutil

    import uvicorn

    metrics_dir = (settings.data_dir / f"metrics-{settings.http.port}").resolve()
    shutil.rmtree(metrics_dir, ignore_errors=True)  # counters start at zero with the server, as with one process
    metrics_dir.mkdir(parents=True)
    settings = settings.with_overrides(
        http={"workers": workers}, dashboards={"prometheus_multiproc_dir": str(metrics_dir)},
        process={"log_format": args.log_format, "log_level": args.log_level},
    )
    # The workers inherit this environment: where the whole Settings is, and prometheus_client's own
    # variable (the library reads it when it is imported).
    from gateway.serving.engine_hosts import EngineHosts

    hosts = EngineHosts(settings)  # hf (process: true) and synthetic models: one engine process for all workers
    handed = settings.data_dir / f"worker-settings-{settings.http.port}"
    try:
        settings = settings.with_overrides(engines={"engine_hosts": hosts.start()})
        os.environ.update({**for_workers(settings, handed), "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
        configure_logging(args.log_format, args.log_level)
        uvicorn.run("gateway.cli.main:worker_app", factory=True, workers=workers, host=settings.http.host, port=settings.http.port,
                    log_level=args.log_level, loop="auto", http="gateway.http.hardening:EnvGuardedHttpToolsProtocol",
                    log_config=None, access_log=False, proxy_headers=False,
                    # uvicorn kills a worker that has not answered its ping within this (5 s by default): on a
                    # loaded host a freshly spawned worker is still importing by then, and is killed every time.
                    timeout_worker_healthcheck=30)
    finally:
        hosts.stop()
        handed.unlink(missing_ok=True)  # the secret's copy goes with the server (a restarted worker needed it until now)


def worker_app() -> Any:
    """One worker's app (`tollgate serve --workers N`): the Settings its parent handed over."""
    from gateway.app import create_app

    settings = worker_settings() or load_settings()
    configure_logging(settings.process.log_format, settings.process.log_level)
    app = create_app(settings, freeze_gc=True)
    _tune_gc(settings)
    from gateway.http.drain import install_in_worker

    install_in_worker(app, settings.http.drain_seconds)  # SIGTERM from the master drains this worker (gateway/http/drain.py)
    return app


def cmd_accounts_create(settings: Settings, args: argparse.Namespace) -> int:
    if not args.name or args.name.strip() != args.name or len(args.name) > 200:  # as POST /admin/accounts checks it
        print("error: an account's name is 1 to 200 characters, without whitespace at either end", file=sys.stderr)
        return 1
    try:
        _print(_with_keys(settings, lambda keys: keys.create_account(args.name)))
    except AccountExists:
        print(f"error: an account named {args.name!r} already exists", file=sys.stderr)
        return 1
    return 0


def cmd_accounts_list(settings: Settings, args: argparse.Namespace) -> int:
    _print(_with_keys(settings, lambda keys: keys.list_accounts()))
    return 0


def cmd_keys_create(settings: Settings, args: argparse.Namespace) -> int:
    async def create(keys: KeyStore) -> Any:
        account = await keys.get_account(name=args.account)
        if account is None:
            raise UnknownAccount(args.account)
        models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
        return await keys.create_key(account["id"], name=args.name, models=models, expires_at=args.expires_at)

    try:
        created = _with_keys(settings, create)
    except UnknownAccount:
        print(f"error: no account named {args.account!r}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _print(created)
    print("The key is shown only this once.", file=sys.stderr)
    return 0


def cmd_keys_list(settings: Settings, args: argparse.Namespace) -> int:
    async def list_(keys: KeyStore) -> Any:
        account_id = None
        if args.account:
            account = await keys.get_account(name=args.account)
            if account is None:
                raise UnknownAccount(args.account)
            account_id = account["id"]
        return await keys.list_keys(account_id)

    try:
        _print(_with_keys(settings, list_))
    except UnknownAccount:
        print(f"error: no account named {args.account!r}", file=sys.stderr)
        return 1
    return 0


LIMIT_FLAGS = ("rpm", "tpm", "max_concurrent", "monthly_tokens", "monthly_spend")


def _limit_changes(args: argparse.Namespace) -> dict[str, Any]:
    changes: dict[str, Any] = {name: None for name in args.clear or []}
    for name in LIMIT_FLAGS:
        value = getattr(args, name)
        if value is not None:
            changes[name] = value if name == "monthly_spend" else int(value)
    return changes


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rpm", type=int, help="requests per minute")
    parser.add_argument("--tpm", type=int, help="tokens per minute")
    parser.add_argument("--max-concurrent", dest="max_concurrent", type=int, help="requests in flight")
    parser.add_argument("--monthly-tokens", dest="monthly_tokens", type=int, help="tokens per calendar month (UTC)")
    parser.add_argument("--monthly-spend", dest="monthly_spend", help="USD per calendar month, a decimal like 25.00")
    parser.add_argument("--clear", nargs="+", choices=LIMIT_FLAGS, help="remove these limits")


def _set_limits(settings: Settings, apply: Callable[[KeyStore], Awaitable[Any]], what: str) -> int:
    from billing.quota.limits import InvalidLimits

    try:
        updated = _with_keys(settings, apply)
    except InvalidLimits as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if updated is None:
        print(f"error: no such {what}", file=sys.stderr)
        return 1
    _print(updated)
    return 0


def cmd_keys_limits(settings: Settings, args: argparse.Namespace) -> int:
    changes = _limit_changes(args)
    return _set_limits(settings, lambda keys: keys.set_key_limits(args.id, changes), "key")


def cmd_accounts_limits(settings: Settings, args: argparse.Namespace) -> int:
    changes = _limit_changes(args)

    async def apply(keys: KeyStore) -> Any:
        account = await keys.get_account(name=args.name)
        return None if account is None else await keys.set_account_limits(account["id"], changes)

    return _set_limits(settings, apply, "account")


def cmd_keys_revoke(settings: Settings, args: argparse.Namespace) -> int:
    revoked = _with_keys(settings, lambda keys: keys.revoke_key(args.id))
    if revoked is None:
        print(f"error: no key with id {args.id}", file=sys.stderr)
        return 1
    _print(revoked)
    return 0


def check_models_file(path: str, quiet: bool, environ: Mapping[str, str]) -> int:
    """Validates a models.yaml (its `api_key_env` names looked up in `environ`, the settings' copy of
    the environment); prints every problem as file:line: field: message."""
    from engines.registry import ModelsConfigError, load_models

    try:
        table = load_models(path, environ=environ)
    except ModelsConfigError as exc:
        print(f"error: {path} is not a usable models file:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    if not quiet:
        for spec in table.specs.values():
            extra = "".join(f" {k}={v}" for k, v in (("aliases", spec.aliases), ("fallbacks", spec.fallbacks)) if v)
            print(f"{spec.id}: {spec.backend}{'' if spec.public else ' (not public)'}{extra}")
    return 0


def cmd_bench(settings: Settings, args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the report
    return cli_bench.report(args, cli_bench.run(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tollgate", description="Token-metered OpenAI-compatible LLM gateway.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="migrate, make sure an admin key exists, and serve the gateway")
    serve.add_argument("--host", help="bind address (default TOLLGATE_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=port_number, help="port (default TOLLGATE_PORT or 8000)")
    serve.add_argument("--models", help="models.yaml: the models to serve (default TOLLGATE_MODELS; else the embedded hf model)")
    serve.add_argument("--check", action="store_true", help="only validate the models file, list its models and exit")
    serve.add_argument("--workers", type=int, help="server processes sharing the port (default TOLLGATE_WORKERS or 1); "
                       "more than one needs remote engines, Postgres and Redis")
    serve.add_argument("--log-level", choices=LOG_LEVELS, help="default TOLLGATE_LOG_LEVEL or info")
    serve.add_argument("--log-format", choices=LOG_FORMATS, help="log lines as JSON or text (default TOLLGATE_LOG_FORMAT or json)")
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="serving benchmark against OpenAI-compatible base URLs (Tollgate or an engine)")
    cli_bench.add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    mig = sub.add_parser("migrate", help="apply database migrations (DATABASE_URL, else the SQLite file)")
    mig.add_argument("--revision", help="target revision (default: head; required with --downgrade, where base drops every table)")
    mig.add_argument("--downgrade", action="store_true", help="downgrade instead of upgrade")
    mig.set_defaults(func=cmd_migrate)

    accounts = sub.add_parser("accounts", help="manage accounts").add_subparsers(dest="action", required=True, metavar="ACTION")
    a_create = accounts.add_parser("create", help="create an account")
    a_create.add_argument("name")
    a_create.set_defaults(func=cmd_accounts_create)
    accounts.add_parser("list", help="list accounts").set_defaults(func=cmd_accounts_list)
    a_limits = accounts.add_parser("limits", help="set or clear an account's limits (caps all its keys together)")
    a_limits.add_argument("name")
    _add_limit_flags(a_limits)
    a_limits.set_defaults(func=cmd_accounts_limits)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="action", required=True, metavar="ACTION")
    k_create = keys.add_parser("create", help="create a key for an account (the secret is printed once)")
    k_create.add_argument("--account", required=True, help="account name")
    k_create.add_argument("--name", help="a label for the key")
    k_create.add_argument("--models", help="comma-separated model ids the key may use (default: all)")
    k_create.add_argument("--expires-at", type=iso_time, help="ISO 8601 expiry time (UTC when no offset)")
    k_create.set_defaults(func=cmd_keys_create)
    k_list = keys.add_parser("list", help="list keys (never their secrets)")
    k_list.add_argument("--account", help="only this account's keys")
    k_list.set_defaults(func=cmd_keys_list)
    k_revoke = keys.add_parser("revoke", help="revoke a key by id")
    k_revoke.add_argument("id", type=db_id)
    k_revoke.set_defaults(func=cmd_keys_revoke)
    k_limits = keys.add_parser("limits", help="set or clear a key's limits")
    k_limits.add_argument("id", type=db_id)
    _add_limit_flags(k_limits)
    k_limits.set_defaults(func=cmd_keys_limits)
    cli_ops.register(sub)
    cli_billing.register(sub)  # invoices, prices
    cli_ledger.register(sub)  # the ledger's partitions
    cli_credits.register(sub)  # prepaid credit
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(load_settings(), args))
    except (SQLAlchemyError, OSError, ValueError, AlembicCommandError, RevisionError, EngineError) as exc:
        # the database, a file, a setting, a migration's revision, a model that does not load: one line, not a traceback
        print(f"error: {_described(exc)}", file=sys.stderr)
        return 1


def _described(exc: Exception) -> str:
    """The first line of what went wrong (a database error's driver message, not its SQL)."""
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    if isinstance(exc, SQLAlchemyError) and ("no such table" in text or ("relation" in text and "does not exist" in text)):
        text += " (is the database migrated? run `tollgate migrate`)"
    return text


if __name__ == "__main__":
    sys.exit(main())
