"""One settings model (gateway/config.py): read from the environment in one place, once; every
TOLLGATE_* name the docs or the code use is one it knows, and one it does not know is reported
at start with the nearest known name; workers get the whole object."""

from __future__ import annotations

import ast
import logging
import re
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.config import KNOWN_VARIABLES, Settings, for_workers, load_settings, unknown_variables, worker_settings

ROOT = Path(__file__).resolve().parents[2]
# Reads of the environment allowed outside gateway/config.py, and why.
ALLOWED = {
    "engines/registry.py": "models.yaml's ${VAR} references are resolved against the environment (the models file's own contract)",
    "engines/hf.py": "XDG_CACHE_HOME, where a converted checkpoint is cached, when the caller gives no cache_dir",
}


def test_a_misspelt_variable_is_reported_with_the_nearest_name(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tollgate.config")
    env = {"TOLLGATE_SCHEDULR_CLASSES": "batch:60", "TOLLGATE_PORT": "9000", "TOLLGATE_TEST_STRICT": "1", "TOLLGATE_XYZZY": "1"}
    settings = load_settings(env)
    assert settings.port == 9000 and settings.scheduler_classes == "interactive:30,batch:600"  # the typo changed nothing
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


def test_nothing_else_reads_the_environment() -> None:
    readers = []
    for package in ("gateway", "engines", "billing", "migrations"):
        for path in (ROOT / package).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel == "gateway/config.py" or rel in ALLOWED:
                continue
            tree = ast.parse(path.read_text())
            parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            for node in ast.walk(tree):
                # os.environ[...] / .get() / os.getenv() read it; os.environ.setdefault() / .update() only set it
                # for libraries (the HF offline flags, prometheus_client's directory for workers)
                if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and getattr(node.value, "id", None) == "os":
                    use = parents.get(id(node))
                    if not (isinstance(use, ast.Attribute) and use.attr in ("setdefault", "update")):
                        readers.append(f"{rel}:{node.lineno}")
    assert readers == []


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
    assert settings.credits_check_seconds == 5 and settings.process.gc_gen0 == 5000
    monkeypatch.delenv("TOLLGATE_WORKER_SETTINGS", raising=False)
    assert worker_settings() is None
    handed = settings.with_overrides(port=9123)  # as `serve` changes it from its flags
    for name, value in for_workers(handed, tmp_path / "w").items():
        monkeypatch.setenv(name, value)
    assert worker_settings() == handed
    assert (tmp_path / "w").stat().st_mode & 0o077 == 0  # it may hold the server secret


def test_settings_made_in_code_take_billing_from_extra() -> None:
    settings = Settings(extra={"TOLLGATE_BILLING_AUTO_CLOSE": "0", "TOLLGATE_CREDITS_CHECK_SECONDS": "0.5"})
    assert settings.billing is not None and settings.billing.auto_close is False and settings.credits_check_seconds == 0.5
