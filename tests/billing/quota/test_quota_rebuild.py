"""Rebuilding a group's counters counts every request once (issue 24; billing/quota/lua/seed.lua,
rehold.lua, recover.lua), on one Redis and on a real local Redis Cluster:

- usage settled while the counters wait for their rebuild (`pend`) counts once: from the ledger
  when the rebuild's snapshot holds its row, from `pend` when it does not;
- rows a gateway has not written to the database yet (a Postgres outage, a replayed journal) are
  put back by that gateway when the group recovers (a failover, another gateway's restart), and the
  rebuild counts them although the ledger does not hold them and Redis lost them;
- a settlement Redis did not take (unreachable) counts once in the rebuild it starts, although the
  rebuild reads the ledger before the row is written;
- a gateway that died with rows only in its journal still counts in a rebuild after a failover that
  lost others' usage (each settlement's `unc` entry, struck off once its row is written);
- a recovery keeps the holds of a process that never comes back (its running requests still count),
  and a process that re-registers drops its own holds it no longer runs (settlements Redis lost).

The failover itself (a master SIGKILLed, its replica promoted) is tests/billing/quota/test_quota_failover.py
and the chaos run across gateways tests/gateway/serving/test_chaos.py; here the recovery is started the way a
restarted gateway starts it (RedisLimiter.recover_groups), which takes the same steps."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from billing import migrate
from billing.db import create_engine
from billing.ledger.journal import Recovered, RunNotes
from billing.ledger.writer import UsageRecord, write_records
from billing.quota.limits import Limits
from billing.quota import LedgerTotals, QuotaExceeded, QuotaUnavailable, RedisLimiter, Scope, month_of, month_start
from billing.quota.redis_limiter import FAILOVER_WAIT
from gateway.wiring import finish_crashed_run
from tests.conftest import REDIS_URL, require_redis, until

NOW = 1_795_000_000.0  # 2026-11, a fixed instant
AT = month_start(NOW).replace(day=2)


@pytest.fixture(scope="module")
def ledger_url(fresh_pg_database: Any) -> str:
    url = fresh_pg_database(migrated=True)
    migrate.upgrade(url)
    return url


@pytest.fixture(params=["redis", "cluster"])
def redis_url(request: pytest.FixtureRequest) -> str:
    if request.param == "cluster":
        return str(request.getfixturevalue("redis_cluster").url)
    require_redis(REDIS_URL)
    return REDIS_URL


@contextlib.asynccontextmanager
async def limiters(ledger_url: str, redis_url: str) -> AsyncIterator[Callable[..., RedisLimiter]]:
    """Limiters ("gateway processes") on one Redis prefix and one ledger; `unwritten` is what each
    one's ledger writer has not written yet."""
    db = create_engine(ledger_url)
    prefix = f"tgrebuild:{uuid.uuid4().hex[:8]}:"
    made: list[RedisLimiter] = []

    def limiter(unwritten: list[UsageRecord] | None = None, **options: Any) -> RedisLimiter:
        rows = unwritten if unwritten is not None else []
        lim = RedisLimiter(redis_url, LedgerTotals(db, pending=lambda: list(rows)), prefix=prefix, timeout=2.0, **options)
        made.append(lim)
        return lim

    try:
        yield limiter
    finally:
        if made:
            await made[0].flush_all()
        for lim in made:
            await lim.close()
        await db.dispose()


@pytest.fixture
async def make(ledger_url: str, redis_url: str) -> AsyncIterator[Callable[..., RedisLimiter]]:
    async with limiters(ledger_url, redis_url) as limiter:
        yield limiter


def scopes() -> tuple[Scope, Scope]:
    account = int(uuid.uuid4().int % 10**9)
    return (Scope("key", int(uuid.uuid4().int % 10**9), Limits(monthly_tokens=100_000), account=account),
            Scope("account", account, Limits(monthly_tokens=100_000)))


def row(request_id: str, key: Scope, account: Scope, tokens: int) -> UsageRecord:
    return UsageRecord(request_id=request_id, account_id=account.id, key_id=key.id, model="m", prompt_tokens=tokens,
                       completion_tokens=0, status="completed", finish_reason="stop", total_ms=1.0, cost_nanos=tokens,
                       created_at=AT, admitted_at=AT)


async def month_tokens(lim: RedisLimiter, *of: Scope) -> list[int]:
    return [(await lim.counters(s, now=NOW))["month_tokens"] for s in of]


async def test_usage_settled_before_a_rebuild_counts_once_whether_or_not_the_ledger_has_its_row(
    make: Callable[..., RedisLimiter], ledger_url: str
) -> None:
    lim = make()
    key, account = scopes()
    first = await lim.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW)
    second = await lim.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW)
    await lim.invalidate(account)  # the group's counters are to be rebuilt (limits changed, a failover)
    await lim.settle(first, 60, 60)
    await lim.settle(second, 70, 70)
    db = create_engine(ledger_url)
    try:
        await write_records(db, [row(first.request_id, key, account, 60)])  # the first's row landed, the second's not yet
    finally:
        await db.dispose()
    await lim.reserve(uuid.uuid4().hex, [key, account], 10, 10, now=NOW)  # rebuilds: ledger 60 + pend 70
    assert await month_tokens(lim, key, account) == [130, 130]


async def test_rows_a_gateway_has_not_written_count_in_a_recovery_although_redis_lost_them(make: Callable[..., RedisLimiter]) -> None:
    key, account = scopes()
    unwritten: list[UsageRecord] = []
    first = make(unwritten)
    hold = await first.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW)
    await first.settle(hold, 50, 50)
    unwritten.append(row(hold.request_id, key, account, 50))  # Postgres is down: the row is in the journal only
    # The settlement is lost with the master that took it.
    await first._redis.delete(*(f"{first.group(account.tag)}{s.name}:mtok:{month_of(NOW)}" for s in (key, account)))
    restarted = make()
    await restarted.recover_groups({account.tag})  # another gateway restarted on a journal with replayed rows
    with pytest.raises(QuotaUnavailable):  # admissions wait for the first to re-register
        await restarted.reserve(uuid.uuid4().hex, [key, account], 10, 10, now=NOW)
    await first.reserve(uuid.uuid4().hex, [key, account], 10, 10, now=NOW)  # re-registers with its unwritten row
    assert await month_tokens(first, key, account) == [50, 50]


async def test_a_settlement_redis_did_not_take_counts_once_although_the_rebuild_runs_before_its_row_is_written(
    make: Callable[..., RedisLimiter], ledger_url: str
) -> None:
    """A settlement that fails (Redis unreachable, here its circuit open) leaves the usage to the
    group's rebuild. The bump that starts the rebuild puts the process's rows not yet written in
    `pend` in the same script, and the hold's release with nothing used (once Redis answers) does not
    overwrite them: the rebuild counts the row once, whether it reads the ledger before or after the
    row lands."""
    key, account = scopes()
    unwritten: list[UsageRecord] = []
    lim, other = make(unwritten), make()
    hold = await lim.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW)
    unwritten.append(row(hold.request_id, key, account, 50))  # recorded before its settlement, as Admission.settle does
    lim.breaker.opened_at, lim.breaker.cooldown = 0.0, 1e9  # Redis unreachable
    assert await lim.settle(hold, 50, 50) is False
    lim.breaker.success()  # Redis answers again
    # The order the watch loop and the next call may take: the bump at the next call, the hold's
    # release in between, then another process's admission rebuilds from a ledger without the row.
    await lim._bump_epochs()
    await lim._release_unsure()
    await other.reserve(uuid.uuid4().hex, [key, account], 10, 10, now=NOW)
    assert await month_tokens(other, key, account) == [50, 50]
    db = create_engine(ledger_url)
    try:
        await write_records(db, [row(hold.request_id, key, account, 50)])  # the row lands afterwards
    finally:
        await db.dispose()
    await other.reserve(uuid.uuid4().hex, [key, account], 10, 10, now=NOW)
    assert await month_tokens(other, key, account) == [50, 50]
    assert (await other.counters(account, now=NOW))["held_tokens"] == 20


async def test_a_dead_gateway_s_unwritten_rows_and_usage_redis_lost_both_count_in_a_rebuild(
    make: Callable[..., RedisLimiter], ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chaos run's overspend: a gateway dies with rows only in its journal (their usage is in the
    counters), then a failover loses another's later settlement (its row is in the ledger). Neither
    the surviving counter (40) nor the ledger (30) holds all of it, and the larger of the two is
    still short: the rebuild must add the dead gateway's settled usage that the ledger lacks, which
    each settlement files under `unc` until its process sees the row written."""
    monkeypatch.setattr("billing.quota.redis_limiter.FAILOVER_WAIT", 0.3)  # the dead one is waited for that long
    key, account = scopes()
    dead, live = make(), make()
    first = await dead.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW)
    await dead.settle(first, 40, 40)  # its row stays in its journal: Postgres was down, then it was killed
    second = await live.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW)
    await live.settle(second, 30, 30)
    db = create_engine(ledger_url)
    try:
        await write_records(db, [row(second.request_id, key, account, 30)])
        live.written([row(second.request_id, key, account, 30)])  # what its ledger writer tells it
        # A failover loses the second settlement (the replica had not received it): its counts, its
        # settle-once marker and its `unc` entry.
        group = live.group(account.tag)
        for s in (key, account):
            await live._redis.decrby(f"{group}{s.name}:mtok:{month_of(NOW)}", 30)
        await live._redis.delete(f"{group}settled:{second.request_id}")
        await live._redis.hdel(f"{group}unc", second.request_id)
        await make().recover_groups({account.tag})  # the group is rebuilt; the dead gateway never re-registers
        deadline = time.monotonic() + 10
        while True:
            try:
                await live.reserve(uuid.uuid4().hex, [key, account], 10, 10, now=NOW)
                break
            except QuotaUnavailable:  # admissions wait for the dead gateway until FAILOVER_WAIT has passed
                assert time.monotonic() < deadline
        assert await month_tokens(live, key, account) == [70, 70]  # ledger 30 + the dead one's 40
        # The dead gateway starts again and writes its journal's row: a later rebuild counts it from
        # the ledger, once, and strikes it off `unc`.
        await write_records(db, [row(first.request_id, key, account, 40)])
    finally:
        await db.dispose()
    await live.invalidate(account)
    await live.reserve(uuid.uuid4().hex, [key, account], 10, 10, now=NOW)
    assert await month_tokens(live, key, account) == [70, 70]
    assert not await live._redis.hexists(f"{group}unc", first.request_id)


async def test_settled_usage_is_struck_off_unc_once_its_row_is_written(make: Callable[..., RedisLimiter]) -> None:
    """`unc` holds only the settlements whose rows the process has not seen written: each confirmation
    from the ledger writer goes with the next settlement in the group, and a row written before its
    settlement was even sent is never filed there."""
    key, account = scopes()
    lim = make()
    holds = [await lim.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW) for _ in range(4)]
    for hold in holds[:3]:
        await lim.settle(hold, 10, 10)
    unc = f"{lim.group(account.tag)}unc"
    assert set(await lim._redis.hkeys(unc)) == {h.request_id for h in holds[:3]}
    lim.written([row(h.request_id, key, account, 10) for h in holds])  # the fourth's row before its settlement
    await lim.settle(holds[3], 10, 10)
    assert await lim._redis.hlen(unc) == 0
    assert await month_tokens(lim, key, account) == [40, 40]
    # A row written while its settlement is on its way: struck off only after that settlement's
    # answer, so the strike cannot reach Redis before the entry it strikes.
    racing = await lim.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW)
    settling = asyncio.create_task(lim.settle(racing, 10, 10))
    await asyncio.sleep(0)  # the settlement is sent, its answer not read
    lim.written([row(racing.request_id, key, account, 10)])
    await settling
    assert await lim._redis.hkeys(unc) == [racing.request_id]
    await lim.settle(await lim.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW), 0, 0)
    assert await lim._redis.hlen(unc) == 0
    # The account goes quiet after its last row is written: the hold watch strikes it off.
    last = await lim.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW)
    await lim.settle(last, 10, 10)
    lim.written([row(last.request_id, key, account, 10)])
    deadline = time.monotonic() + 10
    while await lim._redis.hlen(unc):  # the watch runs once a second
        assert time.monotonic() < deadline, "the quiet account's unc entry stayed"
        await asyncio.sleep(0.1)


async def test_a_batch_line_run_holding_under_its_own_id_counts_once_in_a_rebuild(
    make: Callable[..., RedisLimiter], ledger_url: str
) -> None:
    """A batch line's run holds under an id of its own (`<request id>/<run>`: gateway/serving/admission.py)
    while its ledger row has the request's id (`Hold.row_id`). Its usage is filed in `unc` and `pend`
    under the row's id, struck off once that row is written, and found in the ledger by a rebuild.
    Before, it was filed under the hold's id: never struck off, never found in the ledger, so every
    rebuild for 40 days (a limits change, a failover) counted each batch line twice."""
    lim = make()
    key, account = scopes()
    unc = f"{lim.group(account.tag)}unc"
    lines = [uuid.uuid4().hex for _ in range(2)]
    first = await lim.reserve(f"{lines[0]}/{uuid.uuid4().hex[:12]}", [key, account], 100, 100, now=NOW)
    first.row_id = lines[0]
    await lim.settle(first, 60, 60)
    assert await lim._redis.hkeys(unc) == [lines[0]]
    db = create_engine(ledger_url)
    try:
        await write_records(db, [row(lines[0], key, account, 60)])
        lim.written([row(lines[0], key, account, 60)])
        await lim.settle(await lim.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW), 0, 0)  # carries the strike
        assert await lim._redis.hlen(unc) == 0
        second = await lim.reserve(f"{lines[1]}/{uuid.uuid4().hex[:12]}", [key, account], 100, 100, now=NOW)
        second.row_id = lines[1]
        await lim.invalidate(account)  # settled while the counters wait for their rebuild: `pend`
        await lim.settle(second, 70, 70)
        await write_records(db, [row(lines[1], key, account, 70)])  # its row lands before the rebuild
    finally:
        await db.dispose()
    await lim.reserve(uuid.uuid4().hex, [key, account], 10, 10, now=NOW)  # rebuilds from the ledger: 60 + 70
    assert await month_tokens(lim, key, account) == [130, 130]


async def test_a_failed_watch_round_is_reported_and_the_next_one_puts_lost_holds_back(make: Callable[..., RedisLimiter]) -> None:
    """The hold watch outlives a round that raises: an idle process whose Redis lost its state still
    gets its running request's hold back."""
    lim = make()
    key, account = scopes()
    await lim.reserve(uuid.uuid4().hex, [key, account], 100, 100)  # running: its hold is live; starts the watch
    held = (await lim.counters(account))["held_tokens"]
    assert held > 0
    real = lim._strike_idle

    async def broken_once() -> None:
        lim._strike_idle = real  # type: ignore[method-assign]
        raise RuntimeError("a bug in one round")

    lim._strike_idle = broken_once  # type: ignore[method-assign]
    deadline = time.monotonic() + 10
    while lim.watcher.pulse.failures == 0:
        assert time.monotonic() < deadline, "the failed round was not reported"
        await asyncio.sleep(0.05)
    assert isinstance(lim.watcher.pulse.last_error, RuntimeError)
    await lim.flush_all()  # Redis restarted empty
    while (await lim.counters(account))["held_tokens"] != held:  # the watch runs once a second
        assert time.monotonic() < deadline, "the watch stopped after a failed round: the hold stayed lost"
        await asyncio.sleep(0.1)
    assert lim.watcher.alive and lim.watcher.pulse.failures == 1


async def test_a_restarted_gateway_strikes_off_what_its_crashed_run_filed(make: Callable[..., RedisLimiter]) -> None:
    """The rows a crashed run settled are written by the run that replays its journal: that one
    strikes their `unc` entries off, whether the rows are written before or after it adopts them."""
    key, account = scopes()
    crashed, restarted = make(), make()
    holds = [await crashed.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW) for _ in range(2)]
    for hold in holds:
        await crashed.settle(hold, 10, 10)  # then SIGKILL: the rows are in its journal only
    replayed = [asdict(row(h.request_id, key, account, 10)) for h in holds]
    restarted.written([row(holds[0].request_id, key, account, 10)])  # written before the adoption
    restarted.adopt(replayed)
    restarted.written([row(holds[1].request_id, key, account, 10)])
    await restarted.settle(await restarted.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=NOW), 0, 0)
    assert await restarted._redis.hlen(f"{restarted.group(account.tag)}unc") == 0


async def test_a_recovery_keeps_a_dead_process_holds_and_drops_a_live_one_s_settled_ones(redis_cluster: Any, ledger_url: str) -> None:
    """On Cluster and Sentinel, where a failover can lose writes (one Redis keeps no `scopes` set).
    At the clock's time, not NOW: the live process's hold watch re-registers its holds at the clock's
    time too, and drops those whose expiry has passed (at NOW, all of them): the test waits for one of
    its rounds, so the holds are re-registered by the watch or by the reservation, either way."""
    async with limiters(ledger_url, redis_cluster.url) as make:
        key, account = scopes()
        live, dead = make(), make()
        now = time.time()
        running = await live.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=now)
        settled = await live.reserve(uuid.uuid4().hex, [key, account], 200, 200, now=now)
        live._live.pop(settled.request_id)  # settled, and the settlement lost with the old master
        await dead.reserve(uuid.uuid4().hex, [key, account], 400, 400, now=now)  # its process then dies:
        await dead.watcher.stop()  # its hold watch with it (alive, a round of it re-registered its hold and the wait ended)
        await make().recover_groups({account.tag})  # a third one restarted with replayed rows
        rounds = live.watcher.pulse.rounds
        await until(lambda: live.watcher.pulse.rounds > rounds, "a round of the live process's hold watch")
        with pytest.raises(QuotaUnavailable):  # re-registers, then waits for the dead one (up to 3 s)
            await live.reserve(uuid.uuid4().hex, [key, account], 1, 1, now=now)
        counters = await live.counters(account, now=now)
        assert (counters["in_flight"], counters["held_tokens"]) == (2, 100 + 400)
        assert running.request_id in live._live


async def test_a_restart_drops_the_holds_its_crashed_run_never_journaled(make: Callable[..., RedisLimiter]) -> None:
    """A run SIGKILLed between a reservation and its journal entry leaves a hold no journal knows of:
    the restart on that journal (RedisLimiter.recover_groups with the crashed run's registration)
    drops it with the run's other holds, on one Redis as on a Cluster. Kept, it held a concurrency
    slot and the tokens until it expired (hold_seconds, 15 min by default): the cause of
    test_sigkill_under_load_while_postgres_is_down's rare failures ("holds not released")."""
    key, account = scopes()
    crashed = make(process_id="crashed" + uuid.uuid4().hex)
    for _ in range(2):
        await crashed.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=time.time())
    assert [(await crashed.counters(s))["in_flight"] for s in (key, account)] == [2, 2]
    restarted = make()  # on the crashed run's journal: it knows that run's registration
    await restarted.recover_groups({account.tag}, crashed.process_id)
    assert [(await restarted.counters(s))[n] for s in (key, account) for n in ("in_flight", "held_tokens")] == [0, 0, 0, 0]


async def test_a_restart_drops_its_crashed_runs_holds_where_it_journaled_nothing(make: Callable[..., RedisLimiter]) -> None:
    """Where the crashed run journaled nothing (so no group is rebuilt), its holds are found through
    the groups it noted as it registered in them (gateway/wiring.py keeps them in the journal's
    directory) and dropped alone (forget.lua); another gateway's running request keeps its hold."""
    key, account = scopes()
    noted: list[str] = []
    crashed = make(process_id="crashed" + uuid.uuid4().hex, on_register=noted.append)
    for _ in range(2):
        await crashed.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=time.time())
    await make().reserve(uuid.uuid4().hex, [key, account], 50, 50, now=time.time())  # another gateway's, still running
    assert noted == [account.tag]  # once, before its first hold there
    restarted = make()
    await restarted.forget_run(set(noted), crashed.process_id)
    assert [(await restarted.counters(s))[n] for s in (key, account) for n in ("in_flight", "held_tokens")] == [1, 50, 1, 50]


async def test_a_start_after_a_crash_drops_the_holds_through_the_crashed_runs_notes(
    make: Callable[..., RedisLimiter], tmp_path: Path
) -> None:
    """The whole path a start takes (gateway/wiring.py:finish_crashed_run): the crashed run noted
    its groups in the journal's directory (RunNotes: one append each, kept through a SIGKILL); the
    next run reads them and drops the crashed run's holds. A clean shutdown clears the notes."""
    key, account = scopes()
    crashed_notes = RunNotes(tmp_path / "quota-groups")
    crashed = make(process_id="crashed" + uuid.uuid4().hex, on_register=crashed_notes.note)
    await crashed.reserve(uuid.uuid4().hex, [key, account], 100, 100, now=time.time())
    # SIGKILLed: nothing closes; what it noted is in the file
    notes = RunNotes(tmp_path / "quota-groups")
    assert notes.previous == {account.tag} and (tmp_path / "quota-groups").read_text() == ""  # this run starts its own
    restarted = make(on_register=notes.note)
    await finish_crashed_run(None, restarted, Recovered(), crashed.process_id, notes.previous)  # type: ignore[arg-type]
    assert [(await restarted.counters(s))["in_flight"] for s in (key, account)] == [0, 0]
    await restarted.settle(await restarted.reserve(uuid.uuid4().hex, [key, account], 10, 10, now=time.time()), 10, 10)
    notes.close(clear=not restarted.holding)  # a clean shutdown: nothing for the next run to drop
    assert RunNotes(tmp_path / "quota-groups").previous == set()


async def test_a_plain_redis_restart_rebuilds_only_once_the_other_processes_holds_are_back(ledger_url: str, tmp_path: Path) -> None:
    """Redis restarted without persistence keeps no registry of the processes whose requests still
    run: the first process to reserve after it must not rebuild the counters from the ledger (which
    lacks those requests) before the others' hold watches have put their holds back. B holds 8 of a
    1,000-token budget's 100-token requests; Redis restarts; A asks for 5 more while B's watch is held
    back. A waits (reserve.lua: `starting`) until Redis has been up FAILOVER_WAIT; B's watch, let go
    once A waits, re-registers its holds meanwhile; A gets the 2 that fit. Before, A rebuilt at once
    and got all 5: 1,300 tokens against 1,000 (the spend audit's two-gateway run: $0.017 against a
    $0.01 balance)."""
    from tests.gateway.serving.test_quota_redis_failures import RedisServer

    redis = RedisServer(tmp_path)
    redis.start()
    try:
        async with limiters(ledger_url, redis.url) as make:
            a, b = make(), make()
            account_id = int(uuid.uuid4().int % 10**9)
            key = Scope("key", int(uuid.uuid4().int % 10**9), Limits(), account=account_id)
            account = Scope("account", account_id, Limits(monthly_tokens=1_000))
            for _ in range(8):
                await b.reserve(uuid.uuid4().hex, [key, account], 100, 100)  # running: its watch keeps them
            let_go = asyncio.Event()
            lost_groups = b._client.lost_groups

            async def held_back(*args: Any) -> list[str]:  # B's watch comes round only once A waits
                await let_go.wait()
                return await lost_groups(*args)

            b._client.lost_groups = held_back  # type: ignore[method-assign]
            redis.kill()
            redis.start()  # empty: every hold is gone
            assert await five_once_b_is_back(a, [key, account], let_go) == 2, "admitted without waiting for B's running holds"
            assert (await a.counters(account))["held_tokens"] == 1_000
    finally:
        redis.kill()


async def five_once_b_is_back(a: Any, scopes: list[Scope], let_go: asyncio.Event) -> int:
    """How many of 5 reservations of 100 tokens A gets, B's hold watch let go (`let_go`) once A is
    told to wait (`starting`), or once A is done if it never is."""
    waits = asyncio.Event()
    call = a._call

    async def seen(script: Any, args: list[Any], linger: float = 0.0) -> Any:
        result = await call(script, args, linger)
        if isinstance(result, list) and result and result[0] == "starting":
            waits.set()
        return result

    a._call = seen

    async def five() -> int:
        admitted = 0
        for _ in range(5):
            try:
                await a.reserve(uuid.uuid4().hex, scopes, 100, 100)
                admitted += 1
            except QuotaExceeded:
                pass
        return admitted

    asking = asyncio.create_task(five())
    waiting = asyncio.create_task(waits.wait())
    await asyncio.wait({asking, waiting}, return_when=asyncio.FIRST_COMPLETED)
    let_go.set()
    waiting.cancel()
    return await asking


async def test_a_flushall_under_running_holds_rebuilds_only_once_the_other_processes_holds_are_back(
    ledger_url: str, tmp_path: Path
) -> None:
    """FLUSHALL (or FLUSHDB) empties Redis without a restart: its uptime goes on, so the restart's
    wait (Redis up less than FAILOVER_WAIT) does not apply. B holds 8 of a 1,000-token budget's
    100-token requests; Redis is flushed; A, which has served another account before, asks for 5
    more in B's account while B's hold watch is held back. A must wait for B's holds as after a
    restart (the data set's sentinel, gone with the flush) and get the 2 that fit."""
    import redis.asyncio as redis_asyncio

    from tests.gateway.serving.test_quota_redis_failures import RedisServer

    redis = RedisServer(tmp_path)
    redis.start()
    client = redis_asyncio.Redis.from_url(redis.url)
    try:
        async with limiters(ledger_url, redis.url) as make:
            a, b = make(), make()
            other = Scope("account", int(uuid.uuid4().int % 10**9), Limits(monthly_tokens=1_000))
            await a.settle(await a.reserve(uuid.uuid4().hex, [other], 10, 10), 0, 0)  # A has been serving
            account_id = int(uuid.uuid4().int % 10**9)
            key = Scope("key", int(uuid.uuid4().int % 10**9), Limits(), account=account_id)
            account = Scope("account", account_id, Limits(monthly_tokens=1_000))
            for _ in range(8):
                await b.reserve(uuid.uuid4().hex, [key, account], 100, 100)  # running: its watch keeps them
            let_go = asyncio.Event()
            lost_groups = b._client.lost_groups

            async def held_back(*args: Any) -> list[str]:  # B's watch comes round only once A waits
                await let_go.wait()
                return await lost_groups(*args)

            b._client.lost_groups = held_back  # type: ignore[method-assign]
            await asyncio.sleep(FAILOVER_WAIT + 0.5)  # Redis has been up long enough: a restart's wait is over
            assert await client.flushall()
            assert await five_once_b_is_back(a, [key, account], let_go) == 2, "admitted without waiting for B's running holds"
            assert (await a.counters(account))["held_tokens"] == 1_000
    finally:
        await client.aclose()
        redis.kill()


async def test_a_redis_that_may_evict_is_warned_of_at_startup(ledger_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An eviction loses keys one at a time (a group's counters, a registration), which neither the
    restart's nor the flush's check sees: a Redis with a maxmemory and any policy but noeviction is
    warned of (read from INFO: CONFIG GET is often disabled on managed Redis)."""
    import redis.asyncio as redis_asyncio

    from tests.gateway.serving.test_quota_redis_failures import RedisServer

    redis = RedisServer(tmp_path)
    redis.start()
    client = redis_asyncio.Redis.from_url(redis.url)
    try:
        async with limiters(ledger_url, redis.url) as make:
            lim = make()
            with caplog.at_level("WARNING", logger="tollgate.quota"):
                await client.config_set("maxmemory", "0")
                await client.config_set("maxmemory-policy", "allkeys-lru")  # no maxmemory: nothing is evicted
                assert await lim.check_store() == "allkeys-lru"
                await client.config_set("maxmemory", str(512 * 2**20))
                await client.config_set("maxmemory-policy", "noeviction")
                assert await lim.check_store() == "noeviction"
                assert not [r for r in caplog.records if "maxmemory" in r.getMessage()]
                await client.config_set("maxmemory-policy", "volatile-lru")
                assert await lim.check_store() == "volatile-lru"
            assert [r.levelname for r in caplog.records if "maxmemory-policy volatile-lru" in r.getMessage()] == ["WARNING"]
    finally:
        await client.aclose()
        redis.kill()
