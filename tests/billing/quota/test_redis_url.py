"""REDIS_URL forms (billing/quota/redis_url.py): one Redis, Redis Cluster seed nodes, a Sentinel service;
a malformed one stops the start with its reason, never repeating the password."""

from __future__ import annotations

import pytest

from billing.quota.redis_url import InvalidRedisUrl, parse


def test_the_three_forms() -> None:
    assert parse("redis://127.0.0.1:6379/0").kind == "single" and not parse("redis://h:1/0").replicated
    assert parse("unix:///run/redis.sock").kind == "single"
    cluster = parse("redis+cluster://u:pw@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002")
    assert (cluster.kind, cluster.nodes, cluster.username, cluster.password, cluster.tls) == (
        "cluster", (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002)), "u", "pw", False)
    assert parse("rediss+cluster://h:7000/0").tls and parse("redis+cluster://h:7000").replicated
    sentinel = parse("redis+sentinel://:s3cret@s1:26379,s2:26380/mymaster/2")
    assert (sentinel.kind, sentinel.nodes, sentinel.service, sentinel.db, sentinel.password) == (
        "sentinel", (("s1", 26379), ("s2", 26380)), "mymaster", 2, "s3cret")
    assert parse("redis+sentinel://s1:26379/mymaster").db == 0


@pytest.mark.parametrize("url, reason", [
    ("localhost:6379", "no scheme"),
    ("memcached://h:1", "unknown scheme"),
    ("redis://h1:1,h2:2/0", "several hosts"),
    ("redis+cluster://:hunter2@h:notaport", "is not host:port"),
    ("redis+cluster://h:7000/3", "only database 0"),
    ("redis+sentinel://:hunter2@s1:26379", "/service_name"),
    ("redis+sentinel://s1:26379/m/x", "not a number"),
    ("redis+cluster://:hunter2@/", "names no host"),
])
def test_malformed_urls_say_why_without_the_password(url: str, reason: str) -> None:
    with pytest.raises(InvalidRedisUrl) as info:
        parse(url)
    assert reason in str(info.value) and "hunter2" not in str(info.value)


def test_a_malformed_url_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.config import load_settings

    monkeypatch.setenv("REDIS_URL", "redis+cluster://:hunter2@h:port")
    with pytest.raises(SystemExit) as info:
        load_settings()
    assert "is not host:port" in str(info.value) and "hunter2" not in str(info.value)
    monkeypatch.setenv("REDIS_URL", "redis+cluster://h:7000,h:7001")
    assert load_settings().redis.url == "redis+cluster://h:7000,h:7001"
    monkeypatch.setenv("TOLLGATE_REDIS_PREFIX", "tg:{x}:")
    with pytest.raises(SystemExit, match="braces"):
        load_settings()
