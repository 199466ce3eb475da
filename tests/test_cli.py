"""The `tollgate` console script against a SQLite file."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests import cli_runner


def tollgate(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "TOLLGATE_SECRET")}
    env["TOLLGATE_DATA_DIR"] = str(tmp)
    return cli_runner.tollgate(args, env)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    assert tollgate(tmp_path, "migrate").returncode == 0
    return tmp_path


def test_help_on_every_command(tmp_path: Path) -> None:
    for args in (["--help"], ["serve", "--help"], ["migrate", "--help"], ["accounts", "--help"], ["keys", "create", "--help"]):
        result = tollgate(tmp_path, *args)
        assert result.returncode == 0 and "usage:" in result.stdout


def test_the_installed_console_script_runs_the_cli(tmp_path: Path) -> None:
    """The entry point pip installed (the other tests fork the same `main` from a warm process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "TOLLGATE_SECRET")}
    env["TOLLGATE_DATA_DIR"] = str(tmp_path)
    helped = cli_runner.console_script(["--help"], env)
    assert helped.returncode == 0 and "usage:" in helped.stdout and "accounts" in helped.stdout
    assert cli_runner.console_script(["migrate"], env).returncode == 0
    created = cli_runner.console_script(["accounts", "create", "acme"], env)
    assert created.returncode == 0 and json.loads(created.stdout)["name"] == "acme", created.stderr
    again = cli_runner.console_script(["accounts", "create", "acme"], env)
    assert again.returncode == 1 and "already exists" in again.stderr


def test_accounts_and_keys(data_dir: Path) -> None:
    created = tollgate(data_dir, "accounts", "create", "acme")
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["name"] == "acme"
    assert tollgate(data_dir, "accounts", "create", "acme").returncode == 1

    key = tollgate(data_dir, "keys", "create", "--account", "acme", "--name", "prod", "--models", "a,b")
    assert key.returncode == 0, key.stderr
    made = json.loads(key.stdout)
    assert made["key"].startswith("sk-") and made["models"] == ["a", "b"]

    listed = tollgate(data_dir, "keys", "list", "--account", "acme")
    assert made["key"] not in listed.stdout
    assert [k["id"] for k in json.loads(listed.stdout)] == [made["id"]]

    revoked = tollgate(data_dir, "keys", "revoke", str(made["id"]))
    assert json.loads(revoked.stdout)["revoked_at"] is not None
    assert tollgate(data_dir, "keys", "revoke", "999").returncode == 1
    assert tollgate(data_dir, "keys", "create", "--account", "nobody").returncode == 1
    past = tollgate(data_dir, "keys", "create", "--account", "acme", "--expires-at", "2001-01-01T00:00:00Z")
    assert past.returncode == 1 and "expires_at must be in the future" in past.stderr, past.stderr
    assert (data_dir / "secret").stat().st_mode & 0o077 == 0


def test_bad_input_and_a_bad_database_are_one_line_of_error_not_a_traceback(tmp_path: Path) -> None:
    """What an audit found printing a Python traceback: an unmigrated database, one that does not exist,
    an unknown backend, an id past the database's 32-bit ids, months of partitions by the hundred
    thousand, and an account name the API refuses (it was created)."""
    def refused(*args: str, env: dict[str, str] | None = None, code: int = 1) -> str:
        result = tollgate(tmp_path, *args) if env is None else cli_runner.tollgate(args, env)
        assert result.returncode == code and "Traceback" not in result.stderr, (args, result.stderr)
        return result.stderr

    assert "run `tollgate migrate`" in refused("accounts", "list")  # the SQLite file is not migrated yet
    base = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "TOLLGATE_SECRET")}
    base["TOLLGATE_DATA_DIR"] = str(tmp_path)
    assert "does not exist" in refused("accounts", "list", env={**base, "DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/tg_no_such_db"})
    assert "unsupported database backend" in refused("accounts", "list", env={**base, "DATABASE_URL": "bogus://x"})
    # refused before the model loads (they were a traceback in the JSON log once it had)
    assert "TOLLGATE_ENGINE='foo': without a models file" in refused("serve", env={**base, "TOLLGATE_ENGINE": "foo"}, code=2)
    assert "DATABASE_READ_URL: Could not parse" in refused("serve", env={**base, "DATABASE_READ_URL": "garbage"}, code=2)
    assert "DATABASE_READ_URL: unsupported database backend" in refused("serve", env={**base, "DATABASE_READ_URL": "mysql://x/y"}, code=2)
    assert tollgate(tmp_path, "migrate").returncode == 0
    assert "Can't locate revision identified by 'nosuchrev'" in refused("migrate", "--revision", "nosuchrev")  # was alembic's traceback
    assert "Can't locate revision" in refused("migrate", "--downgrade", "--revision", "nosuchrev")
    assert "--downgrade needs --revision" in refused("migrate", "--downgrade", code=2)  # it went to base: every table dropped
    assert json.loads(tollgate(tmp_path, "accounts", "list").stdout) == []  # still migrated
    assert "not from 1 to 2147483647" in refused("keys", "revoke", "99999999999999999999", code=2)
    assert "not from 1 to 2147483647" in refused("invoices", "show", "0", code=2)
    assert "not from 0 to 120" in refused("ledger", "create-partitions", "--ahead", "100000", code=2)
    for name in ("", " acme"):
        assert "1 to 200 characters" in refused("accounts", "create", name)
    assert json.loads(tollgate(tmp_path, "accounts", "list").stdout) == []
    # times the API refuses, refused the same way by every command that takes one (keys create took
    # them, to an OverflowError when one left datetime's range in UTC)
    for args in (("keys", "create", "--account", "x", "--expires-at"), ("prices", "add", "m", "--input", "1", "--output", "1", "--effective-from"),
                 ("credits", "add", "--account", "x", "--kind", "grant", "--amount", "1", "--expires-at")):
        assert "must be between 1970-01-01" in refused(*args, "0001-01-01T00:00:00+14:00", code=2)
        assert "not an ISO 8601 time" in refused(*args, "tomorrow", code=2)


def test_limits_from_the_cli(data_dir: Path) -> None:
    assert tollgate(data_dir, "accounts", "create", "lim").returncode == 0
    key = json.loads(tollgate(data_dir, "keys", "create", "--account", "lim").stdout)
    done = tollgate(data_dir, "keys", "limits", str(key["id"]), "--rpm", "60", "--monthly-spend", "25.50")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["limits"] == {"rpm": 60, "monthly_spend": "25.50"}
    cleared = json.loads(tollgate(data_dir, "keys", "limits", str(key["id"]), "--clear", "rpm").stdout)
    assert cleared["limits"] == {"monthly_spend": "25.50"}
    bad = tollgate(data_dir, "keys", "limits", str(key["id"]), "--monthly-spend", "abc")
    assert bad.returncode == 1 and "monthly_spend" in bad.stderr
    account = tollgate(data_dir, "accounts", "limits", "lim", "--monthly-tokens", "1000000")
    assert json.loads(account.stdout)["limits"] == {"monthly_tokens": 1000000}
    assert tollgate(data_dir, "accounts", "limits", "nobody", "--rpm", "1").returncode == 1


def test_serve_refuses_workers_it_cannot_keep_exact(tmp_path: Path) -> None:
    """Refused before anything is created: the embedded model would load once per worker, and
    a SQLite ledger and in-process quotas would not be shared."""
    embedded = tollgate(tmp_path, "serve", "--workers", "2")
    assert embedded.returncode == 2 and "remote engines" in embedded.stderr
    models = tmp_path / "models.yaml"
    models.write_text('models:\n  - id: remote\n    backend: openai\n    context_length: 4096\n    replicas: ["http://127.0.0.1:9/v1"]\n')
    shared = tollgate(tmp_path, "serve", "--workers", "2", "--models", str(models))
    assert shared.returncode == 2 and ("REDIS_URL" in shared.stderr or "Postgres" in shared.stderr)
    assert not (tmp_path / "tollgate.db").exists()  # nothing migrated for a server that does not start
    assert tollgate(tmp_path, "serve", "--workers", "0").returncode == 2
    for port in ("70000", "0", "-1"):  # uvicorn listened on 70000 modulo 65536, and took 0 as unset
        refused = tollgate(tmp_path, "serve", "--port", port)
        assert refused.returncode == 2 and "is not a port number (1 to 65535)" in refused.stderr, refused.stderr
