"""Settings, read from the environment in exactly this one place."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.scheduler import PriorityClass

DEFAULT_MODEL_ID = "smollm2-135m-instruct"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise SystemExit(f"{name} must be an integer, got {raw!r}") from exc


def _env_nonnegative(name: str, default: int) -> int:
    value = _env_int(name, default)
    if value < 0:
        raise SystemExit(f"{name} must be 0 or more, got {value}")
    return value


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise SystemExit(f"{name} must be a number, got {raw!r}") from exc


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path(".tollgate")
    database_url: str | None = None  # None: SQLite file in data_dir
    database_read_url: str | None = None  # a replica for dashboards and /v1/usage; None: they read database_url
    redis_url: str | None = None
    server_secret: str | None = None  # None: generated once and kept in data_dir
    admin_key: str | None = None
    model_id: str = DEFAULT_MODEL_ID
    model_path: str | None = None  # HF checkpoint dir or .gguf file; None: the bundled SmolLM2
    engine_backend: str = "hf"
    models_file: str | None = None  # models.yaml; None: serve model_id with the hf engine
    device: str = "cpu"
    max_batch_size: int = 32
    max_queue: int = 256
    kv_cache_tokens: int = 16384  # KV cache capacity of the hf engine; 0 = size from free memory
    max_batch_tokens: int = 1024  # tokens per continuous-batching step (prefill chunk)
    cuda_graphs: bool = True  # hf engine on CUDA only
    # The hf engine's model in a process of its own (engines/hf_process.py); on by default on CUDA.
    engine_process: bool = False
    engine_gather_ms: int = 20  # the engine process gathers a burst after idle up to this long (engines/hf_process.py)
    # The gateway's queue in front of every engine (docs/scheduling.md).
    scheduler: bool = True
    scheduler_capacity: int = 0  # requests let into an engine at once; 0: its batch size / its replicas' slots
    scheduler_capacity_tokens: int = 0  # prompt + max_tokens let in at once; 0: no limit
    scheduler_reserve: int = 1  # slots held for a top-class account with nothing running
    scheduler_classes: str = "interactive:30,batch:600"  # highest first, each with its longest expected wait (s)
    scheduler_max_queue: int = 10_000  # waiting requests per engine beyond which new ones are refused
    max_body_bytes: int = 1 << 20
    key_cache_seconds: float = 1.0
    redis_prefix: str = "tg:q:"
    redis_timeout: float = 0.05  # seconds, every Redis call
    quota_fail_open: bool = False  # False: refuse with 503 while the quota store is unreachable
    quota_hold_seconds: float = 900.0  # a crashed gateway's reservations free up after this
    # Reliability (docs/reliability.md): the ledger journal, the backlog policy, hostile clients.
    ledger_journal: bool = True  # rows go through an fsync'd local file in data_dir/journal
    ledger_fsync_interval: float = 0.05  # seconds; one fsync per window (group commit)
    ledger_max_backlog: int = 0  # rows not yet in the database; 0: keep serving, N: 503 above N
    ledger_linger: float = 0.02  # seconds a batch waits for more rows before its insert (0: none)
    ledger_copy_connections: int = 2  # Postgres: binary COPY on this many connections (billing/ledger_copy.py); 0: one INSERT
    key_stale_seconds: float = 300.0  # serve a cached key this long while the database is unreachable
    request_read_timeout: float = 30.0  # seconds to receive a request's headers and body
    max_header_bytes: int = 64 * 1024
    metrics_token: str | None = None  # set: GET /metrics wants `Authorization: Bearer <token>`
    warmup: bool = True
    responses_retention_days: float = 30.0  # stored Responses (/v1/responses) are kept this long; 0: until deleted
    workers: int = 1  # server processes on one port (remote engines, Postgres and Redis only)
    drain_seconds: float = 30.0  # on SIGTERM, running generations get this long before they are cut (gateway/drain.py)
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def priority_classes(self) -> tuple[PriorityClass, ...]:
        from engines.scheduler import parse_classes

        return parse_classes(self.scheduler_classes)

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "tollgate.db"

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.sqlite_path.resolve()}"

    def with_overrides(self, **kwargs: object) -> "Settings":
        return replace(self, **kwargs)  # type: ignore[arg-type]

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


def _redis_url(raw: str | None) -> str | None:
    """REDIS_URL: one Redis, redis+cluster://host:port,... or redis+sentinel://host:port,.../service
    (billing/redis_url.py); a malformed one stops the start with the reason."""
    if not raw:
        return None
    from billing.redis_url import InvalidRedisUrl, parse

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
    from engines.scheduler import parse_classes

    try:
        parse_classes(raw)
    except ValueError as exc:
        raise SystemExit(f"TOLLGATE_SCHEDULER_CLASSES: {exc}") from None
    return raw


def _admin_key(raw: str | None) -> str | None:
    """TOLLGATE_ADMIN_KEY, refused at start unless authentication would accept it (the one rule:
    billing/keyformat.py). The message never quotes the key."""
    if not raw:
        return None
    from billing.keyformat import key_problem

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
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"TOLLGATE_ENGINE_PROCESS must be auto, 1 or 0, got {raw!r}")


def load_settings() -> Settings:
    env = os.environ
    return Settings(
        host=env.get("TOLLGATE_HOST", "127.0.0.1"),
        port=_env_int("TOLLGATE_PORT", 8000),
        data_dir=Path(env.get("TOLLGATE_DATA_DIR", ".tollgate")),
        database_url=env.get("DATABASE_URL") or None,
        database_read_url=env.get("DATABASE_READ_URL") or None,
        redis_url=_redis_url(env.get("REDIS_URL")),
        server_secret=env.get("TOLLGATE_SECRET") or None,
        admin_key=_admin_key(env.get("TOLLGATE_ADMIN_KEY")),
        model_id=env.get("TOLLGATE_MODEL_ID", DEFAULT_MODEL_ID),
        model_path=env.get("TOLLGATE_MODEL_PATH") or None,
        engine_backend=env.get("TOLLGATE_ENGINE", "hf"),
        models_file=env.get("TOLLGATE_MODELS") or None,
        device=env.get("TOLLGATE_DEVICE", "cpu"),
        engine_process=_engine_process(env.get("TOLLGATE_ENGINE_PROCESS", "auto"), env.get("TOLLGATE_DEVICE", "cpu")),
        engine_gather_ms=_env_nonnegative("TOLLGATE_ENGINE_GATHER_MS", 20),
        max_batch_size=_env_int("TOLLGATE_MAX_BATCH_SIZE", 32),
        max_queue=_env_int("TOLLGATE_MAX_QUEUE", 256),
        kv_cache_tokens=_env_int("TOLLGATE_KV_CACHE_TOKENS", 16384),
        max_batch_tokens=_env_int("TOLLGATE_MAX_BATCH_TOKENS", 1024),
        scheduler=env.get("TOLLGATE_SCHEDULER", "1") not in ("0", "false", "no"),
        scheduler_capacity=_env_int("TOLLGATE_SCHEDULER_CAPACITY", 0),
        scheduler_capacity_tokens=_env_int("TOLLGATE_SCHEDULER_CAPACITY_TOKENS", 0),
        scheduler_reserve=_env_int("TOLLGATE_SCHEDULER_RESERVE", 1),
        scheduler_classes=_classes(env.get("TOLLGATE_SCHEDULER_CLASSES", "interactive:30,batch:600")),
        scheduler_max_queue=_env_int("TOLLGATE_SCHEDULER_MAX_QUEUE", 10_000),
        cuda_graphs=env.get("TOLLGATE_CUDA_GRAPHS", "1") not in ("0", "false", "no"),
        max_body_bytes=_env_int("TOLLGATE_MAX_BODY_BYTES", 1 << 20),
        key_cache_seconds=_env_float("TOLLGATE_KEY_CACHE_SECONDS", 1.0),
        redis_prefix=_redis_prefix(env.get("TOLLGATE_REDIS_PREFIX", "tg:q:")),
        redis_timeout=_env_float("TOLLGATE_REDIS_TIMEOUT_MS", 50.0) / 1000.0,
        quota_fail_open=_fail_mode(env.get("TOLLGATE_QUOTA_FAIL_MODE", "closed")),
        quota_hold_seconds=_env_float("TOLLGATE_QUOTA_HOLD_SECONDS", 900.0),
        ledger_journal=env.get("TOLLGATE_LEDGER_JOURNAL", "1") not in ("0", "false", "no"),
        ledger_fsync_interval=_env_float("TOLLGATE_LEDGER_FSYNC_MS", 50.0) / 1000.0,
        ledger_max_backlog=_env_int("TOLLGATE_LEDGER_MAX_BACKLOG", 0),
        ledger_linger=_env_float("TOLLGATE_LEDGER_LINGER_MS", 20.0) / 1000.0,
        ledger_copy_connections=max(0, _env_int("TOLLGATE_LEDGER_COPY_CONNECTIONS", 2)),
        key_stale_seconds=_env_float("TOLLGATE_KEY_STALE_SECONDS", 300.0),
        request_read_timeout=_env_float("TOLLGATE_REQUEST_READ_SECONDS", 30.0),
        max_header_bytes=_env_int("TOLLGATE_MAX_HEADER_BYTES", 64 * 1024),
        metrics_token=env.get("TOLLGATE_METRICS_TOKEN") or None,
        warmup=env.get("TOLLGATE_WARMUP", "1") not in ("0", "false", "no"),
        workers=max(1, _env_int("TOLLGATE_WORKERS", 1)),
        drain_seconds=max(0.0, _env_float("TOLLGATE_DRAIN_SECONDS", 30.0)),
        responses_retention_days=max(0.0, _env_float("TOLLGATE_RESPONSES_RETENTION_DAYS", 30.0)),
    )
