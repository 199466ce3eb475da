"""One settings model (gateway/config.py): read from the environment in one place, once, into
nested groups; every TOLLGATE_* name the docs or the code use is one it knows, and one it does not
know is reported at start with the nearest known name; workers get the whole object; the engines
take what they used to read from the environment from it."""

from __future__ import annotations

import ast
import logging
import re
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.config import (
    KNOWN_VARIABLES,
    EngineSettings,
    HttpSettings,
    Settings,
    for_workers,
    load_settings,
    unknown_variables,
    worker_settings,
)

ROOT = Path(__file__).resolve().parents[2]
# Writes to the environment allowed outside gateway/config.py, and why; no read is allowed there.
ALLOWED_WRITES = {
    "gateway/cli/main.py": "`serve --workers N` hands its workers the settings file's path and prometheus_client's directory",
    "engines/backends/embeddings.py": "the HF offline flags (setdefault) before the embedding model loads",
}


def test_a_misspelt_variable_is_reported_with_the_nearest_name(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tollgate.config")
    env = {"TOLLGATE_SCHEDULR_CLASSES": "batch:60", "TOLLGATE_PORT": "9000", "TOLLGATE_TEST_STRICT": "1", "TOLLGATE_XYZZY": "1"}
    settings = load_settings(env)
    assert settings.http.port == 9000 and settings.scheduler.classes == "interactive:30,batch:600"  # the typo changed nothing
    warnings = [r.getMessage() for r in caplog.records if r.name == "tollgate.config"]
    assert warnings == [
        "TOLLGATE_SCHEDULR_CLASSES is not a Tollgate setting and is ignored (did you mean TOLLGATE_SCHEDULER_CLASSES?)",
        "TOLLGATE_XYZZY is not a Tollgate setting and is ignored",
    ]


def test_every_documented_and_every_read_name_is_known() -> None:
    documented = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        documented |= set(re.findall(r"\bTOLLGATE_[A-Z0-9_]*[A-Z0-9]\b", doc.read_text()))
    read = set()
    for package in ("gateway", "engines", "billing", "bench"):
        for path in (ROOT / package).rglob("*.py"):
            read |= set(re.findall(r"[\"'](TOLLGATE_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    names = {n for n in documented | read if not n.startswith(("TOLLGATE_TEST_", "TOLLGATE_BENCH_"))}
    assert unknown_variables(dict.fromkeys(names, "x")) == []
    assert not KNOWN_VARIABLES - {n for n in KNOWN_VARIABLES if n in documented or n in read}  # no stale names either


def environment_uses(tree: ast.AST) -> tuple[list[int], list[int]]:
    """Lines that read the environment and lines that only write it. os.environ[...], .get(), a
    copy of it, os.getenv() and `from os import environ` read it; os.environ.setdefault() /
    .update() only set it for libraries and child processes."""
    reads, writes = [], []
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            reads += [node.lineno for a in node.names if a.name in ("environ", "environb", "getenv", "getenvb")]
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv", "getenvb") and getattr(node.value, "id", None) == "os":
            use = parents.get(id(node))
            if isinstance(use, ast.Attribute) and use.attr in ("setdefault", "update"):
                writes.append(node.lineno)
            else:
                reads.append(node.lineno)
    return sorted(reads), sorted(writes)


def test_nothing_else_reads_the_environment() -> None:
    readers, writers = [], set()
    for package in ("gateway", "engines", "billing", "migrations"):
        for path in (ROOT / package).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel == "gateway/config.py":
                continue
            reads, writes = environment_uses(ast.parse(path.read_text()))
            readers += [f"{rel}:{line}" for line in reads]
            if writes:
                writers.add(rel)
    assert readers == [], "only gateway/config.py reads the environment; these read it too"
    assert writers <= set(ALLOWED_WRITES), f"environment writes not in ALLOWED_WRITES: {sorted(writers - set(ALLOWED_WRITES))}"


def test_the_environment_check_sees_every_form_of_read() -> None:
    source = """
import os
from os import getenv
a = os.environ["A"]
b = os.environ.get("B")
c = dict(os.environ)
d = os.getenv("D")
os.environ.setdefault("E", "1")
os.environ.update({"F": "1"})
"""
    assert environment_uses(ast.parse(source)) == ([3, 4, 5, 6, 7], [8, 9])


def test_migrations_do_not_import_the_gateway() -> None:
    tree = ast.parse((ROOT / "migrations" / "env.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.split(".")[0] == "gateway" for m in imported), imported


def test_groups_are_read_once_and_workers_get_the_whole_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"TOLLGATE_CACHE_HIT_PRICE": "0.25", "TOLLGATE_EMBEDDINGS": "off", "TOLLGATE_BILLING_GRACE_SECONDS": "60",
           "TOLLGATE_STRIPE_API_KEY": "sk_test_x", "TOLLGATE_CREDITS_CHECK_SECONDS": "5", "TOLLGATE_GC_GEN0": "5000",
           "TOLLGATE_MODELS": "/x/models.yaml"}
    settings = load_settings(env)
    assert settings.cache.hit_price == Decimal("0.25") and not settings.embeddings.enabled
    assert settings.billing is not None and settings.billing.grace_seconds == 60 and settings.billing.stripe_enabled
    assert settings.credits.check_seconds == 5 and settings.process.gc_gen0 == 5000
    monkeypatch.delenv("TOLLGATE_WORKER_SETTINGS", raising=False)
    assert worker_settings() is None
    handed = settings.with_overrides(http={"port": 9123})  # as `serve` changes it from its flags
    for name, value in for_workers(handed, tmp_path / "w").items():
        monkeypatch.setenv(name, value)
    handed_back = worker_settings()
    assert handed_back == handed and handed_back is not None and handed_back.http.port == 9123
    assert handed_back.engines.environ == env  # models.yaml's api_key_env names are looked up in it, as at start
    assert (tmp_path / "w").stat().st_mode & 0o077 == 0  # it may hold the server secret
    # a file already there (an earlier run's, a restore's) is replaced, not written through with its mode
    (tmp_path / "w").chmod(0o644)
    for_workers(handed, tmp_path / "w")
    assert (tmp_path / "w").stat().st_mode & 0o077 == 0
    # nor is a link there followed: what it points at is left alone
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("not yours")
    (tmp_path / "w").unlink()
    (tmp_path / "w").symlink_to(elsewhere)
    for_workers(handed, tmp_path / "w")
    assert elsewhere.read_text() == "not yours" and not (tmp_path / "w").is_symlink()
    assert (tmp_path / "w").stat().st_mode & 0o077 == 0 and worker_settings() == handed


def test_settings_made_in_code_take_billing_from_extra() -> None:
    settings = Settings(extra={"TOLLGATE_BILLING_AUTO_CLOSE": "0", "TOLLGATE_CREDITS_CHECK_SECONDS": "0.5"})
    assert settings.billing is not None and settings.billing.auto_close is False and settings.credits.check_seconds == 0.5


def test_groups_are_changed_by_a_mapping_or_replaced_whole() -> None:
    settings = load_settings({"TOLLGATE_PORT": "9000", "TOLLGATE_MAX_BODY_BYTES": "1024", "TOLLGATE_SCHEDULER_RESERVE": "3"})
    changed = settings.with_overrides(http={"host": "0.0.0.0"}, scheduler={"enabled": False}, database_url="sqlite:///x.db")
    assert changed.http == HttpSettings(host="0.0.0.0", port=9000, max_body_bytes=1024)  # the group's other fields kept
    assert not changed.scheduler.enabled and changed.scheduler.reserve == 3
    assert changed.database_url == "sqlite:///x.db" and settings.http.host == "127.0.0.1"  # a copy: the original is as it was
    assert settings.with_overrides(http=HttpSettings(workers=2)).http == HttpSettings(workers=2)  # whole: defaults elsewhere
    with pytest.raises(TypeError):
        settings.with_overrides(port=9123)  # the flat names are gone
    with pytest.raises(TypeError):
        settings.with_overrides(http={"prot": 9123})


def test_what_the_engines_read_from_the_environment_is_captured_at_start(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "POOL_KEY": "sk-upstream", "TOLLGATE_MODELS": str(tmp_path / "models.yaml")}
    settings = load_settings(env)
    assert settings.engines.cache_dir == tmp_path / "xdg" / "tollgate" and settings.engines.environ == env
    assert "sk-upstream" not in repr(settings)  # the environment's keys stay out of log lines
    assert load_settings({}).engines.cache_dir == Path.home() / ".cache" / "tollgate"
    assert EngineSettings().environ == {} and EngineSettings().cache_dir is None  # made in code: nothing from os.environ


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("TOLLGATE_PORT", "eighty", "TOLLGATE_PORT must be an integer, got 'eighty'"),
    ("TOLLGATE_DRAIN_SECONDS", "soon", "TOLLGATE_DRAIN_SECONDS must be a number, got 'soon'"),
    ("TOLLGATE_BILLING_LOOKBACK_MONTHS", "3.5", "TOLLGATE_BILLING_LOOKBACK_MONTHS must be an integer, got '3.5'"),
    ("TOLLGATE_BILLING_CHECK_SECONDS", "hourly", "TOLLGATE_BILLING_CHECK_SECONDS must be a number, got 'hourly'"),
])
def test_a_number_that_does_not_parse_stops_the_start_naming_it(name: str, raw: str, message: str) -> None:
    # One parser of numeric settings for the gateway's groups and billing's (billing/config.py).
    with pytest.raises(SystemExit) as stopped:
        load_settings({name: raw})
    assert str(stopped.value) == message
    empty, unset = load_settings({name: ""}), load_settings({})
    assert (empty.http, empty.billing) == (unset.http, unset.billing)  # empty: the default


@pytest.mark.parametrize("raw", ["0", "0.5", "-900", "nan", "inf"])
def test_a_hold_time_too_short_to_renew_stops_the_start(raw: str) -> None:
    # A running request's hold is renewed when half of it is left (billing/quota/base.py:Limiter.renew).
    with pytest.raises(SystemExit) as stopped:
        load_settings({"TOLLGATE_QUOTA_HOLD_SECONDS": raw})
    assert str(stopped.value).startswith(("TOLLGATE_QUOTA_HOLD_SECONDS must be at least 1, got ",
                                          "TOLLGATE_QUOTA_HOLD_SECONDS must be a finite number"))
    assert load_settings({"TOLLGATE_QUOTA_HOLD_SECONDS": "1"}).quotas.hold_seconds == 1.0


FLAGS = {
    "TOLLGATE_CUDA_GRAPHS": lambda s: s.engines.cuda_graphs,
    "TOLLGATE_WARMUP": lambda s: s.engines.warmup,
    "TOLLGATE_SCHEDULER": lambda s: s.scheduler.enabled,
    "TOLLGATE_LEDGER_JOURNAL": lambda s: s.ledger.journal,
    "TOLLGATE_EMBEDDINGS": lambda s: s.embeddings.enabled,
    "TOLLGATE_BATCHES": lambda s: s.batches.enabled,
    "TOLLGATE_BILLING_AUTO_CLOSE": lambda s: s.billing.auto_close,
    "TOLLGATE_STRIPE_SEND_INVOICES": lambda s: s.billing.send_invoices,
    "TOLLGATE_STRIPE_SYNC_AFTER_CLOSE": lambda s: s.billing.sync_after_close,
}


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_every_on_off_setting_reads_the_same_spellings(name: str) -> None:
    # One reader of on/off settings (billing/config.py:env_flag): TOLLGATE_SCHEDULER=off once left
    # the scheduler on (only 0/false/no turned it off) while TOLLGATE_BATCHES=off turned batches off.
    read = FLAGS[name]
    for raw in ("0", "false", "no", "off", "OFF", "False", " off "):
        assert read(load_settings({name: raw})) is False, raw
    for raw in ("1", "true", "yes", "on", "ON", "True"):
        assert read(load_settings({name: raw})) is True, raw
    assert read(load_settings({name: ""})) is read(load_settings({})) is True  # empty: the default
    with pytest.raises(SystemExit) as stopped:
        load_settings({name: "flase"})
    assert str(stopped.value) == f"{name} must be on or off (1/true/yes/on, 0/false/no/off), got 'flase'"


@pytest.mark.parametrize(("name", "raw", "said"), [
    ("TOLLGATE_MAX_BODY_BYTES", "-1", "must be more than 0, got -1"),  # every POST was a 413 "larger than the -1-byte limit"
    ("TOLLGATE_MAX_BATCH_SIZE", "0", "must be more than 0, got 0"),  # every chat a 400 "n must be at most 0"
    ("TOLLGATE_PORT", "70000", "must be at most 65535, got 70000"),  # uvicorn listened on 70000 - 65536
    ("TOLLGATE_PORT", "0", "must be at least 1, got 0"),
    ("TOLLGATE_WORKERS", "0", "must be at least 1, got 0"),  # was 1, quietly
    ("TOLLGATE_DRAIN_SECONDS", "-5", "must be at least 0, got -5"),  # was 0: streams cut at once on SIGTERM
    ("TOLLGATE_DRAIN_SECONDS", "nan", "must be a finite number, got 'nan'"),
    ("TOLLGATE_RESPONSES_RETENTION_DAYS", "-1", "must be at least 0, got -1"),  # was 0: kept forever
    ("TOLLGATE_CACHE_TTL", "abc", "must be a number, got 'abc'"),  # was Python's "could not convert string to float"
    ("TOLLGATE_CREDITS_SETTLE_SECONDS", "-3", "must be at least 0, got -3"),
    ("TOLLGATE_LEDGER_MAX_BACKLOG", "-2", "must be at least 0, got -2"),
    ("TOLLGATE_BILLING_CHECK_SECONDS", "0", "must be more than 0, got 0"),
])
def test_a_setting_out_of_its_range_stops_the_start_naming_it(name: str, raw: str, said: str) -> None:
    """A nonsense value is a mistake to say at start, not one to quietly replace or to serve with (the
    operator audit: a server that said it was ready and then refused every request)."""
    with pytest.raises(SystemExit) as stopped:
        load_settings({name: raw})
    assert str(stopped.value) == f"{name} {said}"


def test_a_zero_that_means_something_is_kept() -> None:
    """0 where the setting gives it a meaning (the review: refused by the first bounds): no credits
    housekeeping loop (an operator who runs it from cron), transformers' own step size, a KV cache sized from free memory."""
    settings = load_settings({"TOLLGATE_CREDITS_CHECK_SECONDS": "0", "TOLLGATE_MAX_BATCH_TOKENS": "0", "TOLLGATE_KV_CACHE_TOKENS": "0"})
    assert (settings.credits.check_seconds, settings.engines.max_batch_tokens, settings.engines.kv_cache_tokens) == (0, 0, 0)


def test_an_empty_host_is_the_default_never_every_interface() -> None:
    assert load_settings({"TOLLGATE_HOST": ""}).http.host == "127.0.0.1"  # uvicorn took "" as 0.0.0.0 and ::
    assert load_settings({"TOLLGATE_HOST": "0.0.0.0"}).http.host == "0.0.0.0"  # asked for: as asked


def test_log_settings_are_read_checked_and_taken_by_serve() -> None:
    """TOLLGATE_LOG_FORMAT / TOLLGATE_LOG_LEVEL: checked like every setting, and `serve` takes them
    when its flags are not given (its flags' defaults used to win, so they did nothing)."""
    from gateway.cli.main import build_parser

    settings = load_settings({"TOLLGATE_LOG_FORMAT": "text", "TOLLGATE_LOG_LEVEL": "WARNING"})
    assert (settings.process.log_format, settings.process.log_level) == ("text", "warning")
    with pytest.raises(SystemExit) as stopped:
        load_settings({"TOLLGATE_LOG_FORMAT": "xml"})
    assert str(stopped.value) == "TOLLGATE_LOG_FORMAT must be one of json, text, got 'xml'"
    args = build_parser().parse_args(["serve"])
    assert (args.log_format, args.log_level) == (None, None)  # unset: the settings' values
