"""The in-process quota backend: one process, the same semantics as Redis, state in dicts (the
event loop serialises it). The embedded default (no REDIS_URL)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from billing.quota.limits import Limits
from billing.quota.base import BALANCE, Hold, LedgerTotals, Limiter, Scope, ScopeTotals, minute_of, month_of


@dataclass
class _ScopeState:
    month: str = ""
    month_tokens: int = 0
    month_nanos: int = 0
    minutes: dict[int, list[int]] = field(default_factory=dict)  # minute -> [requests, tokens]
    holds: dict[str, tuple[int, int, int, float]] = field(default_factory=dict)  # rid -> tokens, nanos, minute, expiry
    balance_synced: bool = False  # prepaid: credits and spent read from the database
    credits: dict[int, int] = field(default_factory=dict)  # credit row id -> nano-USD
    expiring: dict[int, float] = field(default_factory=dict)  # grant row id -> its expiry, until its end is told
    ended: set[int] = field(default_factory=set)  # grants whose end was told
    spent: int = 0
    # Usage settled while the counters wait for their rebuild (invalidated), by ledger row id ->
    # (tokens, nanos, month, whether it spends the balance): the rebuild counts what its ledger read
    # lacks (Redis' `pend`), since the row may still be in the writer's queue.
    unsynced: dict[str, tuple[int, int, str, bool]] = field(default_factory=dict)

    def held(self) -> tuple[int, int]:
        return sum(h[0] for h in self.holds.values()), sum(h[1] for h in self.holds.values())


class MemoryLimiter(Limiter):
    """One process: the same semantics as Redis, state in dicts (the event loop serialises it)."""

    def __init__(self, totals: LedgerTotals, *, hold_seconds: float = 900.0) -> None:
        super().__init__(totals, hold_seconds=hold_seconds)
        self._scopes: dict[str, _ScopeState] = {}
        self._settled: dict[str, float] = {}

    async def _reserve(self, hold: Hold, now: float) -> tuple[Any, ...]:
        # Every hold this process has not settled is a request it still runs: renewed before the
        # expired ones are swept below (there is no crashed process whose holds outlive it here).
        await self.renew(now)
        missing = [s.name for s in hold.scopes if s.name not in self._scopes or self._scopes[s.name].month != hold.month
                   or (s.prepaid and not self._scopes[s.name].balance_synced)]
        if missing:
            return ("sync", missing)
        remaining: list[tuple[int, int]] = []
        for scope in hold.scopes:
            state = self._scopes[scope.name]
            for rid in [r for r, h in state.holds.items() if h[3] <= now]:
                del state.holds[rid]
            rpm, tpm, conc, mtok, mspend, prepaid = scope.limit_args()
            requests, tokens = state.minutes.get(hold.minute, [0, 0])
            held_tok, held_nanos = state.held()
            available = sum(state.credits.values()) - state.spent - held_nanos
            # a grant past its expiry whose end is not told yet: none of it is available (as reserve.lua)
            available -= sum(state.credits.get(g, 0) for g, at in state.expiring.items() if at <= now)
            denied = (
                "rpm" if rpm >= 0 and requests + 1 > rpm else
                "tpm" if tpm >= 0 and tokens + hold.tokens > tpm else
                "max_concurrent" if conc >= 0 and len(state.holds) + 1 > conc else
                "monthly_tokens" if mtok >= 0 and state.month_tokens + held_tok + hold.tokens > mtok else
                "monthly_spend" if mspend >= 0 and state.month_nanos + held_nanos + hold.nanos > mspend else
                BALANCE if prepaid and hold.nanos > available else
                None
            )
            if denied:
                return ("deny", scope.name, denied, [(max(0, rpm - requests), max(0, tpm - tokens)) for _ in hold.scopes],
                        available)  # below zero when a refund took more than was left: said as it is
            remaining.append((rpm - requests - 1, tpm - tokens - hold.tokens))
        expiry = now + self.hold_seconds
        for scope in hold.scopes:
            state = self._scopes[scope.name]
            window = state.minutes.setdefault(hold.minute, [0, 0])
            window[0] += 1
            window[1] += hold.tokens
            for old in [m for m in state.minutes if m < hold.minute - 1]:
                del state.minutes[old]
            state.holds[hold.request_id] = (hold.tokens, hold.nanos, hold.minute, expiry)
        return ("ok", remaining)

    async def _seed(self, hold: Hold, scopes: list[Scope], totals: dict[str, ScopeTotals], now: float, present: Any = None) -> None:
        month, minute = month_of(now), minute_of(now)
        # Which usage settled while waiting the ledger read holds: asked until nothing new has come
        # (a settlement may land during the question), so that from the last answer on nothing awaits
        # and the counters below are put in place in one step.
        read: dict[str, bool] = {}
        while asked := [rid for s in scopes if s.name in self._scopes for rid in self._scopes[s.name].unsynced if rid not in read]:
            found = await present(asked) if present is not None else set()
            read.update((rid, rid in found) for rid in asked)
        for scope in scopes:
            current = self._scopes.get(scope.name)
            t = totals[scope.name]
            if current is None or current.month != month:
                state = _ScopeState(month=month, month_tokens=t.month_tokens, month_nanos=t.month_nanos)
                state.minutes[minute] = [t.minute_requests, t.minute_tokens]
                if current is not None and minute in current.minutes:
                    # This minute: the larger of the kept window (it counts requests still running, which
                    # the ledger lacks) and the ledger's (those that ran while the scope had no limits
                    # took no holds, so the window lacks them); as seed.lua.
                    kept = current.minutes[minute]
                    state.minutes = dict(current.minutes)
                    state.minutes[minute] = [max(kept[0], t.minute_requests), max(kept[1], t.minute_tokens)]
                if current is not None:
                    state.holds, state.unsynced = current.holds, current.unsynced
                    state.balance_synced, state.credits, state.spent = current.balance_synced, current.credits, current.spent
                    state.expiring, state.ended = current.expiring, current.ended
                self._scopes[scope.name] = state
            state = self._scopes[scope.name]
            rebuilt_balance = scope.prepaid and not state.balance_synced
            if rebuilt_balance:
                for entry, nanos, expiry in t.credits:  # rows applied meanwhile stay applied once
                    state.credits.setdefault(entry, nanos)
                    if expiry is not None and entry not in state.ended:
                        state.expiring[entry] = expiry
                    else:  # the ledger says it is no grant still to end (an end this limiter never heard of)
                        state.expiring.pop(entry, None)
                state.spent, state.balance_synced = t.spent, True
            if state.unsynced:
                for rid, (tokens, nanos, of_month, spends) in state.unsynced.items():
                    if read[rid]:
                        continue  # the ledger read holds its row
                    if of_month == state.month:
                        state.month_tokens += tokens
                        state.month_nanos += nanos
                    if spends and rebuilt_balance:
                        state.spent += nanos
                state.unsynced.clear()

    async def _renew(self, holds: list[Hold], expiry: float) -> None:
        for hold in holds:
            for scope in hold.scopes:
                state = self._scopes.get(scope.name)
                if state is not None:
                    state.holds[hold.request_id] = (hold.tokens, hold.nanos, hold.minute, expiry)

    async def settle(self, hold: Hold, tokens: int, nanos: int, background: bool = False) -> bool:
        self._live.pop(hold.request_id, None)
        if hold.degraded or not hold.scopes or hold.request_id in self._settled:
            return False
        now = time.time()
        self._settled[hold.request_id] = now + max(60.0, self.hold_seconds)  # as long as Redis keeps its marker
        if len(self._settled) > 100_000:
            self._settled = {r: t for r, t in self._settled.items() if t > now}
        for scope in hold.scopes:
            state = self._scopes.get(scope.name)
            if state is None:
                continue  # rebuilt later from the ledger, which will hold this row
            held = state.holds.pop(hold.request_id, None)
            if held is not None and held[0] > tokens and held[2] in state.minutes:
                state.minutes[held[2]][1] -= held[0] - tokens
            if state.month == hold.month:
                state.month_tokens += tokens
                state.month_nanos += nanos
            elif not state.month and (tokens or nanos):  # invalidated: its rebuild counts it unless its read holds the row
                state.unsynced[hold.row] = (tokens, nanos, hold.month, scope.prepaid)
            if state.balance_synced and scope.prepaid:  # a hold taken for a postpaid key spent no balance
                state.spent += nanos
        return True

    async def credit(self, account_id: int, entry_id: int | None, nanos: int, *, expires_at: float | None = None,
                     ends_grant: int | None = None) -> None:
        state = self._scopes.setdefault(Scope("account", account_id, Limits()).name, _ScopeState())
        if entry_id is not None:
            state.credits.setdefault(entry_id, nanos)
            if expires_at is not None and entry_id not in state.ended:
                state.expiring[entry_id] = expires_at
        if ends_grant is not None:
            state.expiring.pop(ends_grant, None)
            state.ended.add(ends_grant)

    async def invalidate(self, scope: Scope) -> None:
        state = self._scopes.get(scope.name)
        if state is not None:
            state.month = ""  # counters rebuilt from the ledger at the next admission; holds kept
            state.balance_synced = False

    async def counters(self, scope: Scope, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        state = self._scopes.get(scope.name)
        if state is None:
            return {}
        requests, tokens = state.minutes.get(minute_of(now), [0, 0])
        held_tok, held_nanos = state.held()
        return {
            "minute_requests": requests, "minute_tokens": tokens, "in_flight": len(state.holds),
            "month_tokens": state.month_tokens, "month_nanos": state.month_nanos,
            "held_tokens": held_tok, "held_nanos": held_nanos,
            "credits_nanos": sum(state.credits.values()), "spent_nanos": state.spent,
        }
