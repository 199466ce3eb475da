"""The Redis quota backend: the Lua scripts (billing/quota/lua/) run atomically on Redis, one
round trip each for reserve and settle, shared by every gateway process.

Key layout: every key of one account and its keys shares the group prefix `{p}{a<account>}:`
(`{p}{k<key>}:` for a key reserved without its account), a Redis Cluster hash tag: a reservation
is one atomic script in one round trip on a cluster too. With g = the group prefix:
  {g}{scope}:rpm:{minute}  {g}{scope}:tpm:{minute}           this minute's requests / tokens
  {g}{scope}:mtok:{month}  {g}{scope}:mspend:{month}         committed usage this month
  {g}{scope}:holds (hash rid -> "tok:nanos:minute")  {g}{scope}:hexp (zset rid -> expiry, renewed while it runs)
  {g}{scope}:held:tok  {g}{scope}:held:nanos                 sums of live holds
  {g}{scope}:synced:{month}:{epoch}                          counters valid for this month
  {g}{scope}:cred (hash credit row id -> nanos)  {g}{scope}:cred:sum  {g}{scope}:spent   prepaid balance
  {g}{scope}:bsynced:{epoch}                                 balance read from the database
  {g}procs (zset process id -> registered until; missing = Redis lost the group: re-register live holds)
  {g}epoch (bumped to rebuild the group from the ledger)   {g}settled:{rid} (settle once)
  {g}node (Cluster, Sentinel: the replication id of the master that last reserved here; another
          one = a failover, which may have lost writes: holds re-registered, counters rebuilt)
  alive:{p} (alive:{g} on Redis Cluster)  the data set's sentinel, "<id>/<ms>" (lua/common.lua): gone
          with a FLUSHALL, FLUSHDB or restart; a process that had seen it notes the loss, and rebuilds
          wait for every process's running holds as after a restart. Outside {p}*: flush_all keeps it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout

from billing.periodic import Periodic
from billing.quota import resp
from billing.quota.limits import Limits
from billing.quota.base import Hold, LedgerTotals, group_tag, Limiter, QuotaUnavailable, Scope, ScopeTotals, minute_of, month_of
from billing.quota.scripts import CREDIT_LUA, FORGET_LUA, RECOVER_LUA, REHOLD_LUA, RENEW_LUA, RESERVE_LUA, SEED_LUA, SETTLE_LUA, ScriptClient

log = logging.getLogger("tollgate.quota")
# How long a settlement nobody waits for may wait to share its Redis round trip with the next call
# (usually the next request's reservation: one send and one reply read instead of two each). Its
# hold stays that much longer: conservative (never an overspend), and too short to matter to limits.
SETTLE_LINGER = 0.002
# After a failover, admissions in a group wait this long at most for every process that had
# registered there to re-register its running holds (each does at its next call, an idle one
# within its hold watch's interval); a process that died meanwhile stops counting after that.
# After a plain restart (nothing kept) Redis knows no process to wait for: admissions that need a
# rebuild wait until Redis has been up this long, time for every live process's watch to come round;
# after a FLUSHALL (uptime goes on) this long after a process that had seen the lost data set noticed
# (the sentinel, lua/common.lua).
FAILOVER_WAIT = 3.0


def _watch_failed(exc: Exception) -> None:  # Redis still down: the next round or the next reserve retries
    log.debug("hold watch: %s", type(exc).__name__)


def _row_tag(row: Any) -> str:
    """The group of a ledger row's scopes (its account's; Scope.tag)."""
    return f"a{row.account_id}"


class CircuitBreaker:
    """Opens after `threshold` consecutive failures; lets one probe through after `cooldown`."""

    def __init__(self, threshold: int = 5, cooldown: float = 1.0) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.failures = 0
        self.opened_at: float | None = None

    def allow(self) -> bool:
        if self.opened_at is None:
            return True
        return time.monotonic() - self.opened_at >= self.cooldown

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None

    def failure(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            self.opened_at = time.monotonic()


class RedisLimiter(Limiter):
    def __init__(
        self,
        url: str,
        totals: LedgerTotals,
        *,
        prefix: str = "tg:q:",
        timeout: float = 0.05,
        fail_open: bool = False,
        hold_seconds: float = 900.0,
        breaker: CircuitBreaker | None = None,
        max_connections: int = 64,
        lean: bool = True,
        process_id: str | None = None,
        on_register: Callable[[str], None] | None = None,
    ) -> None:
        """`lean`: run the Lua scripts through billing.quota.resp (one pipelined connection, a fraction of
        redis-py's CPU per call) where the URL is redis://; redis-py's scripts otherwise (rediss://,
        unix://, or lean=False). Everything else goes through redis-py either way. `on_register`: told
        each group's tag the first time this process registers there (before any hold of its there),
        so a restart after a crash knows where the crashed run may have left holds (forget_run)."""
        super().__init__(totals, hold_seconds=hold_seconds)
        self.prefix = prefix
        self.fail_open = fail_open
        self.breaker = breaker or CircuitBreaker()
        # Groups whose usage went unrecorded in Redis (admitted while it was unreachable, a settlement
        # that failed): their counters are rebuilt from the ledger once Redis answers again.
        self._resync: set[str] = set()
        # `_live` (Limiter's): holds this process reserved and has not settled, renewed every round of
        # the hold watch and re-registered if Redis loses them (a restart, a failover): counters
        # rebuilt from the ledger alone would not see requests still running.
        self._reserving: set[str] = set()  # reservations sent, their answer not read yet
        self._proc = process_id or uuid.uuid4().hex  # this process's registration in each group
        self._on_register = on_register
        self._registered: set[str] = set()  # the groups on_register has been told of
        self._key_groups: dict[int, str] = {}  # key id -> its group's tag, as reservations showed
        self._groups: dict[str, str] = {}  # tag -> its group's key prefix
        # The data set this process registered in (sentinel key -> its id): a registration that finds
        # another one, or none, means Redis lost its data (rehold.lua notes the loss).
        self._datasets: dict[str, str] = {}
        # Holds to release with nothing counted once Redis answers: reservations whose answer never
        # came, settlements that failed (their usage comes back with the group's rebuild).
        self._unsure: dict[str, Hold] = {}
        # Settled usage whose row the database has not confirmed: each settlement also files its usage
        # under the group's `unc` hash (rid -> usage), and the request ids the ledger has written since
        # go with this process's next settlement there, to be struck off. A rebuild counts every `unc`
        # entry its ledger read does not hold: a gateway that died with rows only in its journal is
        # still counted after a failover, although no live process can put those rows back.
        self._unc_sent: dict[str, str] = {}  # rid -> group tag: settlements sent with their usage filed
        self._written_early: dict[str, None] = {}  # rows written before their settlement was sent (oldest first)
        self._struck: dict[str, list[str]] = {}  # group tag -> rids written, to strike off `unc`
        self._struck_waiting: set[str] = set()  # groups whose strikes waited a whole watch round
        # An idle process notices a Redis restart (or a failover) too, so its running requests' holds
        # come back within a second even if it admits nothing new; started by the first reservation.
        self._closed = False
        # Rounds at least four times in the renewal margin (half the hold time), so a running
        # request's hold is renewed well before it would expire.
        self.watcher = Periodic("quota-hold-watch", min(1.0, hold_seconds / 8), self._watch_round, on_error=_watch_failed)
        self._client = ScriptClient(url, timeout=timeout, max_connections=max_connections, lean=lean)
        self._redis = self._client.redis
        (self._reserve_script, self._settle_script, self._seed_script, self._rehold_script, self._credit_script,
         self._recover_script, self._renew_script, self._forget_script) = (
            self._client.script(lua) for lua in (RESERVE_LUA, SETTLE_LUA, SEED_LUA, REHOLD_LUA, CREDIT_LUA, RECOVER_LUA, RENEW_LUA,
                                                 FORGET_LUA)
        )

    @property
    def process_id(self) -> str:
        return self._proc

    @property
    def lean(self) -> bool:
        """Whether the scripts run through billing.quota.resp rather than redis-py."""
        return self._client.lean

    def group(self, tag: str) -> str:
        """The prefix of every key of one group (`<prefix>{<tag>}:`): one Redis Cluster hash slot."""
        prefix = self._groups.get(tag)
        if prefix is None:  # once per group (each reserve and settle asks): a bounded cache of the strings
            if len(self._groups) >= 100_000:
                self._groups.clear()
            prefix = self._groups[tag] = f"{self.prefix}{{{tag}}}:"
        return prefix

    async def _call(self, script: Any, args: list[Any], linger: float = 0.0) -> Any:
        """One round trip, guarded by the breaker; raises QuotaUnavailable when Redis is out.
        `linger`: the call may wait that long to leave with the next one (redis-py sends at once).
        args[0] is the group's prefix, so its epoch key routes the call on a cluster."""
        if not self.breaker.allow():
            raise QuotaUnavailable("quota store unavailable (circuit open)")
        key = args[0] + "epoch"
        try:
            if self._resync:
                await self._bump_epochs()
            try:
                result = await self._client.run(script, key, args, linger)
            except (TimeoutError, asyncio.TimeoutError, RedisTimeout, RedisConnectionError, resp.RespConnectionError):
                # One retry: a busy event loop can miss a short deadline although Redis answered, and a
                # pooled connection to a Redis that restarted fails once before the pool reconnects.
                # Every script is idempotent by request id, so a call that did run is not counted twice.
                result = await self._client.run(script, key, args, 0.0)  # the retry goes at once
        except Exception as exc:  # connection refused, timeout, server error
            self.breaker.failure()
            log.warning("quota store call failed: %s", type(exc).__name__)
            raise QuotaUnavailable(str(type(exc).__name__)) from None
        self.breaker.success()
        return result

    async def _bump_epochs(self) -> None:
        """Groups whose usage went unrecorded in Redis (admitted while it was unreachable, a settlement
        that failed) are rebuilt from the ledger. Each bump goes with this process's rows the database
        has not confirmed yet (rehold.lua puts them in `pend` in the same script): a rebuild that
        starts before a row is written still counts it, once."""
        tags = sorted(self._resync)
        self._resync.difference_update(tags)
        now = time.time()
        for tag in tags:
            args, live = self._rehold_args(tag, now, bump=True)
            try:
                mark = await self._client.run(self._rehold_script, self.group(tag) + "epoch", args, 0.0)
            except BaseException:
                self._resync.update(tags[tags.index(tag):])  # still to do: the next call tries again
                raise
            self._dataset(self._alive(tag), mark)
            self._renewed(live, now + self.hold_seconds)

    def _grouped(self, scopes: list[Scope], tag: str) -> None:
        for scope in scopes:
            if scope.kind == "key":
                self._key_groups[scope.id] = tag

    def reserve_args(self, hold: Hold, now: float) -> list[Any]:
        """The reservation script's arguments (bench/overhead_floor.py calls the script itself)."""
        args: list[Any] = [
            self.group(hold.tag), f"{now:.3f}", hold.request_id, hold.minute, hold.month,
            f"{now + self.hold_seconds:.3f}", hold.tokens, hold.nanos, len(hold.scopes),
        ]
        for scope in hold.scopes:
            args += [scope.name, *scope.limit_args()]
        args += [self._proc, 1 if self._client.replicated else 0, int(FAILOVER_WAIT * 1000), self._alive(hold.tag)]
        return args

    def _alive(self, tag: str) -> str:
        """The data set's sentinel key (lua/common.lua): one per prefix; one per group on Redis Cluster,
        where a script reaches no key outside its group's slot."""
        return f"alive:{self.group(tag) if self._client.cluster else self.prefix}"

    def _dataset(self, alive: str, mark: Any) -> None:
        """Remembers the data set a registration found (rehold.lua's answer, '<id>/<ms>')."""
        if isinstance(mark, bytes):
            mark = mark.decode()
        if isinstance(mark, str) and "/" in mark:
            if len(self._datasets) >= 100_000:
                self._datasets.clear()
            self._datasets[alive] = mark.rsplit("/", 1)[0]

    async def _reserve(self, hold: Hold, now: float) -> tuple[Any, ...]:
        args = self.reserve_args(hold, now)
        self._watch()
        self._reserving.add(hold.request_id)  # a re-registration meanwhile must not drop its hold
        try:
            try:
                result = await self._call(self._reserve_script, args)
                if result[0] == "lost":
                    if len(result) > 1 and int(result[1]):  # a failover: our rows reach the ledger before the rebuild
                        await self.totals.flush()
                    await self._rehold(hold.tag, now)
                    result = await self._call(self._reserve_script, args)
                if result[0] == "starting":
                    result = await self._after_start(args, result)
                if result[0] == "recovering":
                    raise QuotaUnavailable("quota store recovering from a failover")
            except QuotaUnavailable:
                # The call may have reserved before its answer was lost (a failover, a timeout): released
                # once Redis answers again, so a refused request leaves no hold behind.
                if len(self._unsure) < 10_000:
                    self._unsure[hold.request_id] = hold
                if self.fail_open:
                    self._resync.add(hold.tag)
                    return ("degraded",)
                raise
            if result[0] == "lost":
                raise QuotaUnavailable("quota store keeps losing its state")
            if result[0] == "ok":
                return ("ok", [tuple(r) for r in result[1]])
            if result[0] == "deny":
                return ("deny", result[1], result[2], [tuple(r) for r in result[3]], int(result[4]))
            return ("sync", list(result[1]))
        finally:
            self._reserving.discard(hold.request_id)

    async def _after_start(self, args: list[Any], result: Any) -> Any:
        """Redis started moments ago without its state and the group needs its counters rebuilt: the
        reservation waits until the other processes' hold watches have had FAILOVER_WAIT to put their
        running holds back (reserve.lua answers `starting` and the milliseconds left), then asks again."""
        deadline = time.monotonic() + FAILOVER_WAIT + 1.0
        while result[0] == "starting":
            if time.monotonic() >= deadline:  # the script counts from Redis's own start: this is a clock gone wrong
                raise QuotaUnavailable("quota store restarting")
            await asyncio.sleep(min(0.25, max(0.01, int(result[1]) / 1000)))
            result = await self._call(self._reserve_script, args)
        return result

    async def _seed(self, hold: Hold, scopes: list[Scope], totals: dict[str, ScopeTotals], now: float,
                    present: Any = None) -> None:
        args: list[Any] = [self.group(hold.tag), month_of(now), minute_of(now), len(scopes)]
        for scope in scopes:
            t = totals[scope.name]
            args += [scope.name, t.month_tokens, t.month_nanos, t.minute_requests, t.minute_tokens]
        prepaid = [s for s in scopes if s.prepaid]
        args.append(len(prepaid))
        for scope in prepaid:
            t = totals[scope.name]
            args += [scope.name, t.spent, len(t.credits)]
            for entry, nanos, expiry in t.credits:
                args += [entry, nanos, "" if expiry is None else f"{expiry:.3f}"]
        # Usage settled while the counters were lost (`pend`) counts unless `totals` already hold its
        # row: the script names the request ids it needs to know about, asked in the same ledger read.
        held: set[str] = set()
        lacking: set[str] = set()
        for _ in range(20):
            result = await self._call(self._seed_script, [*args, len(held), *held, len(lacking), *lacking])
            if not isinstance(result, list) or result[0] != "check":
                return
            unknown = [str(r) for r in result[1]]
            found = await present(unknown) if present is not None else set()
            held.update(found)
            lacking.update(r for r in unknown if r not in found)
        raise QuotaUnavailable("quota counters could not be rebuilt (usage kept arriving)")

    async def credit(self, account_id: int, entry_id: int | None, nanos: int, *, expires_at: float | None = None,
                     ends_grant: int | None = None) -> None:
        account = Scope("account", account_id, Limits())
        await self._client.run(self._credit_script, self.group(account.tag) + "epoch",
                               [self.group(account.tag), account.name, "" if entry_id is None else entry_id, nanos,
                                "" if expires_at is None else f"{expires_at:.3f}", "" if ends_grant is None else ends_grant])

    async def _rehold(self, tag: str, now: float) -> None:
        """Puts this process's unsettled holds of one group back (after Redis lost them) and registers
        the process there."""
        if self._on_register is not None and tag not in self._registered:
            self._registered.add(tag)
            self._on_register(tag)  # before the registration: a hold here can only follow it
        args, live = self._rehold_args(tag, now)
        self._dataset(self._alive(tag), await self._call(self._rehold_script, args))
        self._renewed(live, now + self.hold_seconds)
        if live:
            log.warning("quota store lost its state: re-registered %d holds of requests still running", len(live))

    def _rehold_args(self, tag: str, now: float, bump: bool = False) -> tuple[list[Any], list[Hold]]:
        """rehold.lua's arguments, and the live holds they re-register (each renewed: a full hold
        time from `now`); `bump`: the script first starts a new epoch (a rebuild)."""
        live = [h for h, _ in self._live.values() if h.tag == tag]
        expiry = f"{now + self.hold_seconds:.3f}"
        args: list[Any] = [self.group(tag), self._proc, f"{now:.3f}", 86400, len(live)]
        for hold in live:
            args += [hold.request_id, hold.tokens, hold.nanos, hold.minute, expiry, len(hold.scopes), *[s.name for s in hold.scopes]]
        # Rows of requests whose holds are settled but that may not be in the ledger yet: a rebuild
        # must count them (a request still holding is counted by its settlement, not here).
        rows = {h.row for h, _ in self._live.values()}
        unwritten = [r for r in self._unwritten() if _row_tag(r) == tag and r.request_id not in rows]
        args.append(len(unwritten))
        for row in unwritten:
            month = month_of(row.admitted_at.timestamp())
            spends = ":0" if getattr(row, "postpaid", False) else ""  # a postpaid key's row spends no balance
            args += [row.request_id, f"{row.prompt_tokens + row.completion_tokens}:{row.cost_nanos or 0}:{month}{spends}",
                     month, 2, f"k{row.key_id}", f"a{row.account_id}"]
        alive = self._alive(tag)
        args += [len(self._reserving), *self._reserving, 1 if bump else 0, alive, self._datasets.get(alive, ""), int(FAILOVER_WAIT * 1000)]
        return args, live

    def _watch(self) -> None:
        # Started by the first reservation (it needs the running loop); a settlement during shutdown
        # does not start it again.
        if not self._closed and not self.watcher.alive:
            self.watcher.start()

    async def _watch_round(self) -> None:
        if not self.breaker.allow():
            return
        if self._unsure:
            await self._release_unsure()
        await self._strike_idle()
        unwritten = self._unwritten()
        if not self._live and not unwritten:
            return
        now = time.time()
        tags = sorted({h.tag for h, _ in self._live.values()} | {_row_tag(r) for r in unwritten})
        for tag in await self._client.lost_groups([self.group(t) for t in tags], tags, self._proc, now):
            await self._rehold(tag, now)
        await self.renew(now)

    async def _renew(self, holds: list[Hold], expiry: float) -> None:
        groups: dict[str, list[Hold]] = {}
        for hold in holds:
            groups.setdefault(hold.tag, []).append(hold)
        for tag, group in groups.items():
            args: list[Any] = [self.group(tag), f"{expiry:.3f}", self._proc, len(group)]
            for hold in group:
                args += [hold.request_id, hold.tokens, hold.nanos, hold.minute, len(hold.scopes), *[s.name for s in hold.scopes]]
            await self._call(self._renew_script, args)

    async def _strike_idle(self) -> None:
        """Strikes off `unc` the written rows of groups with no settlement to carry them since the
        last round (an account gone quiet), so its entries do not stay in Redis until it is busy again."""
        waited = [tag for tag in self._struck_waiting if self._struck.get(tag)]
        self._struck_waiting = set(self._struck)
        for tag in waited:
            rids = self._struck.pop(tag)
            try:
                await self._redis.hdel(self.group(tag) + "unc", *rids)
            except Exception as exc:  # left for the group's next rebuild, which strikes them off too
                log.debug("unc strike-off: %s", type(exc).__name__)

    def _unwritten(self) -> list[Any]:
        """This process's ledger rows not confirmed in the database (a read-back without a writer: none)."""
        pending = getattr(self.totals, "pending", None)
        return pending() if pending is not None else []

    async def recover_groups(self, tags: set[str], previous_proc: str | None = None) -> None:
        """After a restart that replayed rows a crashed run had settled (counted, or lost with a failover
        meanwhile): each group is rebuilt from the ledger and every process's unwritten rows, as after
        a failover (recover.lua). `previous_proc`: the crashed run's registration, not waited for."""
        now = time.time()
        for tag in sorted(tags):
            group = self.group(tag)
            await self._client.run(self._recover_script, group + "epoch", [group, previous_proc or "", int(FAILOVER_WAIT * 1000)])
            await self._rehold(tag, now)
        if tags:
            log.warning("quota counters of %d account groups rebuilt after a restart with unwritten ledger rows", len(tags))

    async def forget_run(self, tags: set[str], previous_proc: str) -> None:
        """After a restart: drops the holds the crashed run (`previous_proc`) left in groups whose
        counters need no rebuild (it journaled nothing there): reservations it was killed before
        journaling, settlements it lost. Left, they would hold a concurrency slot and their tokens
        until they expired (hold_seconds)."""
        for tag in sorted(tags):
            await self._client.run(self._forget_script, self.group(tag) + "epoch", [self.group(tag), previous_proc])

    async def _release_unsure(self) -> None:
        for rid, hold in list(self._unsure.items()):
            try:
                await self._call(self._settle_script, self._settle_args(hold, 0, 0))
            except QuotaUnavailable:
                return  # still out: the next round
            self._unsure.pop(rid, None)

    def _settle_args(self, hold: Hold, tokens: int, nanos: int, file_usage: bool = False) -> list[Any]:
        # The settle-once marker lives as long as a hold does (a repeat of a settlement comes from
        # the immediate retry, never later: an interrupted request's release only follows a process
        # that never settled it), not a day: a day of markers is ~86M keys at 1,000 requests/s.
        keep = max(60, int(self.hold_seconds))
        tag = hold.tag or group_tag(hold.scopes)
        strike = self._struck.pop(tag, None) or []
        if len(strike) > 500:
            strike, self._struck[tag] = strike[:500], strike[500:]
        return [self.group(tag), hold.request_id, hold.month, tokens, nanos, len(hold.scopes), *[s.name for s in hold.scopes], keep,
                1 if file_usage else 0, len(strike), *strike, hold.row, "".join("1" if s.prepaid else "0" for s in hold.scopes)]

    def _filed(self, rid: str, tag: str) -> None:
        """A settlement that filed its usage in `unc` has been answered (or failed): from now on its
        row's confirmation strikes the entry off, and a strike can only reach Redis after the entry."""
        if rid in self._written_early:  # written while the settlement was on its way
            del self._written_early[rid]
            self._struck.setdefault(tag, []).append(rid)
            return
        self._unc_sent[rid] = tag
        if len(self._unc_sent) > 1_000_000:  # rows this process's ledger never confirms (no writer)
            del self._unc_sent[next(iter(self._unc_sent))]

    def written(self, rows: list[Any]) -> None:
        """The ledger writer's confirmation of `rows`: their usage need not be kept in `unc` any more
        (struck off with this process's next settlement in the group, or by the hold watch once they
        have waited a whole round for one)."""
        self._watch()  # strikes off a quiet group's entries
        sent, early = self._unc_sent, self._written_early
        for row in rows:
            tag = sent.pop(row.request_id, None)
            if tag is not None:
                self._struck.setdefault(tag, []).append(row.request_id)
            else:  # its settlement not sent yet, or never to be (a request with no limit, a replayed row)
                early[row.request_id] = None
                if len(early) > 10_000:  # the oldest are rows that were never settled here
                    del early[next(iter(early))]

    def adopt(self, rows: list[dict[str, Any]]) -> None:
        """Rows a crashed run of this journal had settled (its settlements filed their usage in `unc`)
        and this process now writes: struck off once written, as if this process had settled them."""
        for row in rows:
            self._filed(row["request_id"], f"a{row['account_id']}")

    async def settle(self, hold: Hold, tokens: int, nanos: int, background: bool = False) -> bool:
        self._live.pop(hold.request_id, None)
        if hold.degraded or not hold.scopes:
            return False
        rid = hold.row  # usage is filed, and struck off once written, under the ledger row's id
        file_usage = bool(tokens or nanos)  # filed in `unc` until the row is written (settle.lua)
        if file_usage and rid in self._written_early:  # written already: nothing to file
            del self._written_early[rid]
            file_usage = False
        try:
            return bool(await self._call(self._settle_script, self._settle_args(hold, tokens, nanos, file_usage),
                                         SETTLE_LINGER if background else 0.0))
        except QuotaUnavailable:
            # The ledger row carries the usage for the next rebuild; the hold is released (with
            # nothing counted) once Redis answers again, rather than held until it expires.
            self._resync.add(hold.tag or group_tag(hold.scopes))
            if len(self._unsure) < 10_000:
                self._unsure[hold.request_id] = hold
            self._watch()  # a process that only settles (a restart releasing its journal's holds) releases them too
            return False
        finally:
            if file_usage:
                self._filed(rid, hold.tag or group_tag(hold.scopes))

    async def _tag_of(self, scope: Scope) -> str:
        """The group of a scope named without its account (a key, from the dashboard or the admin API)."""
        if scope.kind == "account" or scope.account is not None:
            return scope.tag
        known = self._key_groups.get(scope.id)
        if known is not None:
            return known
        try:
            account = await self.totals.account_of_key(scope.id)
        except Exception as exc:  # the database is out: find the key's counters in Redis itself
            log.debug("key %s's account from Redis (database: %s)", scope.id, type(exc).__name__)
            suffix = f"}}:{scope.name}:"
            async for name in self._redis.scan_iter(match=f"{self.prefix}{{a*{suffix}*", count=1000):
                return str(name)[len(self.prefix) + 1:str(name).index(suffix)]
            return scope.tag
        return scope.tag if account is None else f"a{account}"

    async def invalidate(self, scope: Scope) -> None:
        tag = scope.tag
        try:
            tag = await self._tag_of(scope)
            # A new epoch: every scope of the group is rebuilt from the ledger at its next admission.
            await self._client.incr_all([self.group(tag) + "epoch"])
        except Exception as exc:
            log.warning("could not invalidate quota counters for %s: %s", scope.name, type(exc).__name__)
            self._resync.add(tag)

    async def check_store(self) -> str | None:
        """At startup: warns when Redis may evict keys (a `maxmemory` with any policy but `noeviction`).
        An eviction loses counters, holds or registrations one key at a time, which no restart or
        flush check sees: a group could be rebuilt without other processes' running holds, or not at
        all. Read from INFO (CONFIG GET is often disabled on managed Redis); where INFO is refused
        too, or on Redis Cluster (each master has its own settings), it says so at debug level and
        checks nothing. Returns the policy read (None: not read)."""
        try:
            info = await self._redis.info("memory")
        except Exception as exc:
            log.debug("quota store's eviction policy not read: %s", type(exc).__name__)
            return None
        if not isinstance(info, dict) or "maxmemory_policy" not in info:  # a cluster: one dict per node
            return None
        policy, limit = str(info["maxmemory_policy"]), int(info.get("maxmemory") or 0)
        if policy != "noeviction" and limit > 0:
            log.warning("quota store: Redis runs with maxmemory %d and maxmemory-policy %s: an eviction can lose quota "
                        "counters and holds and let a budget be overspent; run it with maxmemory-policy noeviction", limit, policy)
        return policy

    async def reachable(self) -> bool:
        try:
            return bool(await self._redis.ping())  # within the client's timeout; refused at once when Redis is down
        except Exception:
            return False

    async def counters(self, scope: Scope, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        k = f"{self.group(await self._tag_of(scope))}{scope.name}:"
        minute, month = minute_of(now), month_of(now)
        names = [f"rpm:{minute}", f"tpm:{minute}", f"mtok:{month}", f"mspend:{month}", "held:tok", "held:nanos", "cred:sum", "spent"]
        values = await self._redis.mget([k + n for n in names])  # one group: one hash slot
        in_flight = await self._redis.zcard(k + "hexp")
        ints = [int(v or 0) for v in values]
        return {
            "minute_requests": ints[0], "minute_tokens": ints[1], "in_flight": int(in_flight),
            "month_tokens": ints[2], "month_nanos": ints[3], "held_tokens": ints[4], "held_nanos": ints[5],
            "credits_nanos": ints[6], "spent_nanos": ints[7],
        }

    async def flush_all(self) -> None:
        """Deletes every counter under the prefix (tests and operators use it to simulate a loss)."""
        await self._client.delete_matching(f"{self.prefix}*")

    async def close(self) -> None:
        self._closed = True
        await self.watcher.stop()
        await self._client.close()
