"""What `REDIS_URL` names, and the redis-py client for it.

  redis://[user:pass@]host:port/db          one Redis (also rediss://, unix://: redis-py's own forms)
  redis+cluster://[user:pass@]host:port,host:port,...     Redis Cluster, from these seed nodes
  rediss+cluster://...                                    the same over TLS
  redis+sentinel://[user:pass@]host:port,host:port,.../service_name[/db]
                                            the master Sentinel names for `service_name` (the
                                            password is the data nodes'; sentinels without one)

Every Redis use (quotas, the response cache) connects through `connect`, so each works on all
three. A URL that names none of these is refused at start (`InvalidRedisUrl`), its password
never repeated in the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

__all__ = ["InvalidRedisUrl", "RedisTarget", "connect", "parse"]


class InvalidRedisUrl(ValueError):
    """REDIS_URL is malformed; the message says why (without the password)."""


@dataclass(frozen=True)
class RedisTarget:
    kind: str  # "single" | "cluster" | "sentinel"
    url: str  # single: the URL as given (redis-py parses it)
    nodes: tuple[tuple[str, int], ...] = ()  # cluster seed nodes, or the sentinels
    service: str = ""  # sentinel: the monitored master's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False

    @property
    def replicated(self) -> bool:
        """Whether a failover can move the keys to another master (the quota scripts then check)."""
        return self.kind != "single"


def redacted(url: str) -> str:
    """The URL with its password replaced, for messages."""
    head, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    userinfo, _, tail = rest.partition("@")
    user = userinfo.split(":", 1)[0]
    return f"{head}://{user}:***@{tail}" if ":" in userinfo else f"{head}://***@{tail}"


def _nodes(hosts: str, url: str) -> tuple[tuple[str, int], ...]:
    nodes = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep:
            host, port = item.strip(), "6379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidRedisUrl(f"REDIS_URL {redacted(url)!r}: {item.strip()!r} is not host:port")
        nodes.append((host, int(port)))
    return tuple(nodes)


def parse(url: str) -> RedisTarget:
    """What `url` names; raises InvalidRedisUrl."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise InvalidRedisUrl(f"REDIS_URL {redacted(url)!r} has no scheme (redis://, redis+cluster://, redis+sentinel://)")
    if scheme in ("redis", "rediss", "unix"):
        if scheme != "unix" and not rest.split("/", 1)[0].rpartition("@")[2]:
            raise InvalidRedisUrl(f"REDIS_URL {redacted(url)!r} names no host")
        if scheme != "unix" and "," in rest.split("/", 1)[0]:
            raise InvalidRedisUrl(f"REDIS_URL {redacted(url)!r} names several hosts: use redis+cluster:// or redis+sentinel://")
        return RedisTarget("single", url)
    if scheme not in ("redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel"):
        raise InvalidRedisUrl(f"REDIS_URL {redacted(url)!r}: unknown scheme {scheme!r} "
                              "(redis://, rediss://, unix://, redis+cluster://, redis+sentinel://)")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
        if not colon:  # redis://secret@host: redis-py reads a lone userinfo as the password
            username, password = None, unquote(user) or None
    if not hosts:
        raise InvalidRedisUrl(f"REDIS_URL {redacted(url)!r} names no host")
    nodes = _nodes(hosts, url)
    parts = [p for p in path.split("/") if p]
    options = {k: v[0] for k, v in parse_qs(query).items() if v}
    tls = scheme.startswith("rediss")
    if scheme.endswith("+cluster"):
        if parts and parts != ["0"]:
            raise InvalidRedisUrl(f"REDIS_URL {redacted(url)!r}: Redis Cluster has only database 0")
        return RedisTarget("cluster", url, nodes, username=username, password=password, tls=tls)
    if not parts or len(parts) > 2:
        raise InvalidRedisUrl(f"REDIS_URL {redacted(url)!r}: a Sentinel URL ends in /service_name or /service_name/db")
    db_text = parts[1] if len(parts) == 2 else options.get("db", "0")
    if not db_text.isdigit():
        raise InvalidRedisUrl(f"REDIS_URL {redacted(url)!r}: database {db_text!r} is not a number")
    return RedisTarget("sentinel", url, nodes, service=unquote(parts[0]), db=int(db_text), username=username,
                       password=password, tls=tls)


def connect(target: RedisTarget | str, *, timeout: float | None, max_connections: int = 64, decode_responses: bool = False,
            blocking_pool: bool = False) -> Any:
    """A redis-py asyncio client for `target`: `Redis`, `RedisCluster` (follows MOVED/ASK and
    refreshes its slot map after a failover), or Sentinel's master (finds the new master after one).
    `timeout`: every socket operation and connect. Retries inside redis-py are at most one, without
    backoff: the caller's own retry and breaker rules decide the rest."""
    import redis.asyncio as redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    if isinstance(target, str):
        target = parse(target)
    common: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=decode_responses)
    if target.kind == "single":
        if blocking_pool:
            # A bounded pool that queues callers briefly instead of failing when all connections are busy.
            pool = redis.BlockingConnectionPool.from_url(target.url, max_connections=max_connections, timeout=2.0,
                                                         retry_on_timeout=False, **common)
            return redis.Redis(connection_pool=pool)
        return redis.Redis.from_url(target.url, **common)
    auth: dict[str, Any] = dict(username=target.username, password=target.password)
    if target.kind == "cluster":
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.nodes], max_connections=max_connections,
                            retry=Retry(NoBackoff(), 1), ssl=target.tls, **auth, **common)
    from redis.asyncio.sentinel import Sentinel

    sentinel = Sentinel(list(target.nodes), sentinel_kwargs=dict(socket_timeout=timeout, socket_connect_timeout=timeout),
                        retry=Retry(NoBackoff(), 1), ssl=target.tls, db=target.db, max_connections=max_connections,
                        **auth, **common)
    return sentinel.master_for(target.service)
