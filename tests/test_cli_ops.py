"""`tollgate usage` and `tollgate models` against a SQLite file with real ledger rows."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest

from billing.db import create_engine
from billing.ledger.writer import UsageRecord, write_records
from gateway.config import DEFAULT_MODEL_ID
from tests.conftest import run_coro
from tests.test_cli import tollgate


def record(account_id: int, key_id: int, model: str, at: datetime, prompt: int, completion: int, cost: int | None) -> UsageRecord:
    return UsageRecord(uuid.uuid4().hex, account_id, key_id, model, prompt, completion, "completed", "stop", 100.0,
                       cost_nanos=cost, created_at=at)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    assert tollgate(tmp_path, "migrate").returncode == 0
    acme = json.loads(tollgate(tmp_path, "accounts", "create", "acme").stdout)
    other = json.loads(tollgate(tmp_path, "accounts", "create", "other").stdout)
    key = json.loads(tollgate(tmp_path, "keys", "create", "--account", "acme").stdout)
    nov, dec = datetime(2026, 11, 5, 10, tzinfo=timezone.utc), datetime(2026, 12, 1, 0, 30, tzinfo=timezone.utc)
    rows = [
        record(acme["id"], key["id"], "m-a", nov, 100, 20, 1_500_000_000),
        record(acme["id"], key["id"], "m-a", nov.replace(day=20), 50, 5, 250_000),
        record(acme["id"], key["id"], "m-b", nov, 7, 3, None),
        record(acme["id"], key["id"], "m-a", dec, 1000, 1000, 10**9),  # next month
        record(other["id"], 99, "m-a", nov, 5000, 5000, 10**9),  # another account
    ]

    async def write() -> None:
        db = create_engine(f"sqlite:///{tmp_path / 'tollgate.db'}")
        try:
            await write_records(db, rows)
        finally:
            await db.dispose()

    run_coro(write())
    return tmp_path


def test_usage_for_a_month(data_dir: Path) -> None:
    result = tollgate(data_dir, "usage", "--account", "acme", "--month", "2026-11", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_model = {r["model"]: r for r in report["data"]}
    assert by_model["m-a"]["requests"] == 2 and by_model["m-a"]["prompt_tokens"] == 150
    assert by_model["m-a"]["cost_usd"] == "1.500250000"
    assert by_model["m-b"]["unpriced"] == 1 and by_model["m-b"]["cost_nanos"] == 0
    assert report["totals"]["requests"] == 3 and report["totals"]["total_tokens"] == 185

    table = tollgate(data_dir, "usage", "--account", "acme", "--month", "2026-11")
    lines = table.stdout.splitlines()
    assert lines[0].startswith("usage of acme, 2026-11-01 to 2026-12-01")
    assert lines[-1].split() == ["total", "3", "157", "28", "185", "1.500250000", "0", "0"]

    by_day = json.loads(tollgate(data_dir, "usage", "--account", "acme", "--month", "2026-11", "--by", "day", "--json").stdout)
    assert [(r["day"], r["requests"]) for r in by_day["data"]] == [("2026-11-05", 2), ("2026-11-20", 1)]
    everyone = json.loads(tollgate(data_dir, "usage", "--month", "2026-11", "--json").stdout)
    assert everyone["account"] is None and everyone["totals"]["requests"] == 4

    assert tollgate(data_dir, "usage", "--account", "nobody").returncode == 1
    bad = tollgate(data_dir, "usage", "--month", "2026-13")
    assert bad.returncode == 1 and "--month" in bad.stderr


def test_models_list_and_help(data_dir: Path) -> None:
    listed = tollgate(data_dir, "models", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [model] = json.loads(listed.stdout)
    assert model["id"] == DEFAULT_MODEL_ID and model["backend"] == "hf" and model["price"] is None
    assert DEFAULT_MODEL_ID in tollgate(data_dir, "models", "list").stdout
    for args in (["usage", "--help"], ["models", "--help"], ["models", "list", "--help"], ["models", "load", "--help"]):
        result = tollgate(data_dir, *args)
        assert result.returncode == 0 and "usage:" in result.stdout, args
