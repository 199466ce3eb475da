"""Runs the Alembic history programmatically (used by the CLI, the server start and the tests)."""

from __future__ import annotations

import threading
from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["database_url"] = database_url
    return cfg


def _in_thread(fn, *args) -> None:  # type: ignore[no-untyped-def]
    # env.py runs its own event loop; a thread keeps that legal when a loop already runs here.
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn(*args)
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def upgrade(database_url: str, revision: str = "head") -> None:
    _in_thread(command.upgrade, alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    _in_thread(command.downgrade, alembic_config(database_url), revision)
