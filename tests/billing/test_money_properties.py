"""Property tests (hypothesis) on money: invoice lines sum to the total, each line is rounded as
docs/billing.md says (half up to whole cents, once per line, from exact decimals), re-running a
close changes nothing, and settling a quota hold twice counts it once (both limiter backends)."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import defaultdict
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from billing import migrate
from billing.db import create_engine
from billing.invoices.views import get_invoice, list_invoices
from billing.invoices.close import close_period, line_amount_cents
from billing.quota.limits import Limits
from billing.invoices.periods import Period
from billing.prices.book import PriceBook
from billing.quota import Limiter, MemoryLimiter, RedisLimiter, Scope, ScopeTotals
from tests.billing.invoice_helpers import new_account, usage
from tests.conftest import REDIS_URL, run_coro

PRICES = st.decimals(min_value=0, max_value=100, places=3)
TOKENS = st.integers(min_value=0, max_value=5_000_000)
STATUSES = st.sampled_from(["completed", "cancelled", "error", "interrupted"])
PROPERTY_SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def documented_cents(tokens: int, usd_per_million: Decimal) -> int:
    """docs/billing.md, independently: tokens x price / 1e6 in exact fractions, half up to cents."""
    cents = Fraction(tokens) * Fraction(usd_per_million) * 100 / 1_000_000
    floor = cents.numerator // cents.denominator
    return floor + (1 if cents - floor >= Fraction(1, 2) else 0)


@given(tokens=st.integers(min_value=0, max_value=10**15), price=st.decimals(min_value=0, max_value=10**6, places=9))
@settings(max_examples=500, derandomize=True)
def test_a_line_is_rounded_half_up_once(tokens: int, price: Decimal) -> None:
    assert line_amount_cents(tokens, price) == documented_cents(tokens, price)


@given(n=st.integers(min_value=0, max_value=10**6), price=st.sampled_from(["0.001", "0.004", "0.005", "0.125", "0.200", "0.250", "1.000", "2.500"]))
@settings(max_examples=200, derandomize=True)
def test_exact_half_cents_round_up(n: int, price: str) -> None:
    tokens = Fraction(2 * n + 1, 2) * 10_000 / Fraction(Decimal(price))  # tokens x price / 1e6 = n + 0.5 cents
    if tokens.denominator == 1:
        assert line_amount_cents(int(tokens), Decimal(price)) == n + 1 == documented_cents(int(tokens), Decimal(price))


def test_the_documented_examples() -> None:
    assert line_amount_cents(25_000, Decimal("0.200")) == 1  # 0.5 cent shows as $0.01 (docs/billing.md)
    assert line_amount_cents(24_999, Decimal("0.200")) == 0
    assert line_amount_cents(10**6, None) == 0  # unpriced usage: not charged


@pytest.fixture(scope="module")
def money_db(fresh_pg_database: Any) -> str:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    return url


PERIODS = itertools.count()
ROW = st.tuples(st.integers(0, 2), TOKENS, TOKENS, STATUSES, st.integers(0, 27), st.integers(0, 23))


@given(prices=st.lists(st.tuples(PRICES, PRICES), min_size=3, max_size=3), change=st.none() | st.tuples(PRICES, PRICES),
       rows=st.lists(ROW, min_size=1, max_size=25))
@PROPERTY_SETTINGS
def test_invoice_lines_sum_to_the_total_and_a_rerun_changes_nothing(
    money_db: str, prices: list[tuple[Decimal, Decimal]], change: tuple[Decimal, Decimal] | None, rows: list[Any]
) -> None:
    n = next(PERIODS)
    period = Period.month(1990 + n // 12, n % 12 + 1)  # a month of its own per example

    async def scenario() -> None:
        db = create_engine(money_db)
        try:
            book = PriceBook(db)
            tag = uuid.uuid4().hex[:6]
            models = [f"m{i}-{tag}" for i in range(3)]
            for model, (inp, out) in zip(models, prices):
                await book.add(model, inp, out, period.start, backdate=True)
            if change is not None:  # model 0 changes price mid-month: two lines per direction
                await book.add(models[0], change[0], change[1], period.start + timedelta(days=14), backdate=True)
            account = await new_account(db)
            expected: dict[tuple[str, str], int] = defaultdict(int)
            for model_i, prompt, completion, status, day, hour in rows:
                when = period.start + timedelta(days=day, hours=hour)
                await usage(db, account, models[model_i], prompt, completion, when, status=status)
                if status in ("completed", "cancelled"):
                    expected[(models[model_i], "input")] += prompt
                    expected[(models[model_i], "output")] += completion
            first = await close_period(db, book, period, now=period.end + timedelta(hours=1))
            invoices = await list_invoices(db, account_id=account, period=str(period))
            if not any(expected.values()):
                assert invoices == [] or all(i["total_cents"] == 0 for i in invoices)
                return
            [listed] = invoices
            invoice = await get_invoice(db, listed["id"])
            assert invoice is not None
            lines = invoice["lines"]
            assert invoice["total_cents"] == sum(line["amount_cents"] for line in lines)
            billed: dict[tuple[str, str], int] = defaultdict(int)
            for line in lines:
                unit = Decimal(line["unit_price_per_million"]) if line["unit_price_per_million"] is not None else None
                assert line["amount_cents"] == (documented_cents(line["tokens"], unit) if unit is not None else 0)
                billed[(line["model"], line["direction"])] += line["tokens"]
            assert {k: v for k, v in billed.items() if v} == {k: v for k, v in expected.items() if v}

            again = await close_period(db, book, period, now=period.end + timedelta(days=3))
            assert again.view()["invoice_ids"] == first.view()["invoice_ids"]
            assert await get_invoice(db, listed["id"]) == invoice  # same lines, same total, same everything
            async with db.connect() as conn:
                count = (await conn.execute(sa.text("SELECT count(*) FROM invoices WHERE account_id = :a"), {"a": account})).scalar_one()
            assert count == 1
        finally:
            await db.dispose()

    run_coro(scenario())


class NoLedger:
    """Counters start from an empty ledger (the property is about settlement, not rebuilding)."""

    async def for_scopes(self, scopes: list[Scope], now: float) -> dict[str, ScopeTotals]:
        return {s.name: ScopeTotals() for s in scopes}


HOLDS = st.lists(st.tuples(st.integers(1, 1000), st.integers(0, 1000), st.integers(1, 3)), min_size=1, max_size=12)


async def settle_property(limiter: Limiter, holds: list[tuple[int, int, int]], unsettled: int) -> None:
    """Reserve each hold; settle all but the last `unsettled` of them `repeats` times, concurrently."""
    key, account = Scope("key", 7, Limits(monthly_tokens=10**12)), Scope("account", 3, Limits(monthly_tokens=10**12))
    reserved = [await limiter.reserve(uuid.uuid4().hex, [key, account], worst, worst * 10) for worst, _used, _r in holds]
    to_settle = list(zip(reserved, holds))[: len(holds) - unsettled]
    results = await asyncio.gather(*[
        limiter.settle(hold, min(used, worst), min(used, worst) * 10)
        for hold, (worst, used, repeats) in to_settle for _ in range(repeats)
    ])
    assert sum(results) == len(to_settle)  # exactly one settle per hold reports success
    for hold, (worst, used, repeats) in to_settle:  # and a late retry counts nothing either
        assert await limiter.settle(hold, min(used, worst), 0) is False
    for scope in (key, account):
        c = await limiter.counters(scope)
        assert c["month_tokens"] == sum(min(used, worst) for _h, (worst, used, _r) in to_settle)
        assert c["month_nanos"] == 10 * c["month_tokens"]
        assert c["in_flight"] == unsettled
        assert c["held_tokens"] == sum(worst for worst, _u, _r in holds[len(holds) - unsettled:])


@given(holds=HOLDS, unsettled=st.integers(0, 2))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_settling_twice_counts_once_in_memory(holds: list[tuple[int, int, int]], unsettled: int) -> None:
    asyncio.run(settle_property(MemoryLimiter(NoLedger()), holds, min(unsettled, len(holds))))  # type: ignore[arg-type]


@given(holds=HOLDS, unsettled=st.integers(0, 2))
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_settling_twice_counts_once_in_redis(holds: list[tuple[int, int, int]], unsettled: int) -> None:
    async def scenario() -> None:
        limiter = RedisLimiter(REDIS_URL, NoLedger(), prefix=f"tgprop:{uuid.uuid4().hex[:8]}:", timeout=1.0)  # type: ignore[arg-type]
        try:
            await settle_property(limiter, holds, min(unsettled, len(holds)))
            await limiter.flush_all()
        finally:
            await limiter.close()

    run_coro(scenario())


@PROPERTY_SETTINGS
@given(
    inp=st.decimals(min_value=0, max_value=100, places=9), out=st.decimals(min_value=0, max_value=100, places=9),
    prompt=TOKENS, completion=TOKENS,
)
def test_a_requests_cost_is_exact_nanos_half_up(inp: Decimal, out: Decimal, prompt: int, completion: int) -> None:
    # Whole nano-units per token (integer arithmetic) or not (exact decimals): the documented rounding either way.
    from billing.prices.book import EffectivePrice

    for a, b in ((inp, out), (inp.quantize(Decimal("0.001")), out.quantize(Decimal("0.001")))):
        price = EffectivePrice("m", a, b, "usd", None, None)
        exact = (Fraction(prompt) * Fraction(a) + Fraction(completion) * Fraction(b)) * 1000
        assert price.cost_nanos(prompt, completion) == int(exact + Fraction(1, 2))  # half up (all non-negative)
