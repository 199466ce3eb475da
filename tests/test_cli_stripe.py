"""`tollgate invoices credit` when Stripe fails (the FAKE Stripe of tests/fakes/stripe_server.py answers
500): a one-line error on stderr and exit status 1, as the CLI's other errors, not a traceback; the
credit note stays issued and the message says so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from billing.db import create_engine
from billing.invoices.models import Invoice
from tests.billing.invoice_helpers import at, usage
from tests.conftest import run_coro
from tests.fakes.stripe_server import FakeStripe
from tests.test_cli import tollgate

SELLER = {"TOLLGATE_SELLER_NAME": "Tollgate Networks Ltd", "TOLLGATE_SELLER_ADDRESS": "1 Gate Street|London EC1A 1AA",
          "TOLLGATE_SELLER_COUNTRY": "GB", "TOLLGATE_SELLER_EMAIL": "billing@tollgate.example"}


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    server = FakeStripe().start()
    try:
        yield server
    finally:
        server.stop()


def test_a_stripe_error_in_invoices_credit_is_one_line_and_exit_1(tmp_path: Path, fake: FakeStripe,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SELLER.items():
        monkeypatch.setenv(name, value)
    assert tollgate(tmp_path, "migrate").returncode == 0
    assert tollgate(tmp_path, "accounts", "create", "acme").returncode == 0
    assert tollgate(tmp_path, "prices", "add", "alpha", "--input", "1.000", "--output", "1.000",
                    "--effective-from", "2026-08-01T00:00:00Z", "--backdate").returncode == 0

    async def seed() -> None:
        db = create_engine(f"sqlite:///{tmp_path / 'tollgate.db'}")
        try:
            await usage(db, 1, "alpha", 1_234_567, 0, at(10, 5))
        finally:
            await db.dispose()

    run_coro(seed())
    assert tollgate(tmp_path, "invoices", "close", "--period", "2026-10", "--no-progress").returncode == 0
    [listed] = json.loads(tollgate(tmp_path, "invoices", "list").stdout)

    async def on_stripe() -> None:  # the invoice went to Stripe earlier
        db = create_engine(f"sqlite:///{tmp_path / 'tollgate.db'}")
        try:
            async with db.begin() as conn:
                table = Invoice.__table__  # type: ignore[attr-defined]
                await conn.execute(sa.update(table).where(table.c.id == listed["id"]).values(stripe_invoice_id="in_test_1"))
        finally:
            await db.dispose()

    run_coro(on_stripe())
    for name, value in {"TOLLGATE_STRIPE_API_KEY": fake.api_key, "TOLLGATE_STRIPE_API_BASE": fake.url,
                        "TOLLGATE_STRIPE_MAX_RETRIES": "0", "TOLLGATE_STRIPE_SYNC_AFTER_CLOSE": "0"}.items():
        monkeypatch.setenv(name, value)
    fake.fail("GET", r"/v1/invoices/.*", status=500, times=5)
    credit = tollgate(tmp_path, "invoices", "credit", str(listed["id"]), "--amount-cents", "48")
    assert credit.returncode == 1, (credit.stdout, credit.stderr)
    assert "Traceback" not in credit.stderr, credit.stderr
    lines = [line for line in credit.stderr.splitlines() if " INFO " not in line]  # the CLI logs Stripe's requests at INFO
    assert len(lines) == 1 and lines[0].startswith("error: credit note CN-000001"), credit.stderr
    assert "did not reach Stripe" in lines[0] and "APIError" in lines[0] and f"tollgate invoices sync {listed['id']}" in lines[0]
    assert fake.count("GET", r"/v1/invoices/.*") >= 1  # it did ask Stripe
