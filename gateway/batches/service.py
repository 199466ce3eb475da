"""The Batch API's part of the lifespan: its stores and its runner, built once and stopped at shutdown."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from billing.batches.store import BatchStore
from billing.batches.files import SqlFileStore
from engines.wrappers.scheduler import parse_classes
from gateway.batches.runner import BatchRunner

log = logging.getLogger("tollgate.batches")
START_SWEEP_SECONDS = 10.0  # a database slow to answer does not hold the start longer than this


async def start(app: Any) -> None:
    state = app.state
    settings = state.settings
    if not settings.batches.enabled:
        return
    classes = parse_classes(settings.scheduler.classes)
    state.files = SqlFileStore(state.db)
    state.batch_store = BatchStore(state.db)
    # The runner's id is kept with this process's journal: a line the previous run on it marked
    # admitted and never journaled (killed in between) is known to have no row coming (BatchRunner.sweep).
    journal = state.ledger.journal
    runner_id, previous = journal.run_ids("batch-runner") if journal is not None else (None, None)
    state.batch_runner = BatchRunner(
        app, state.batch_store, state.files, state.keys, settings.batches,
        lowest_class=classes[-1].name if len(classes) > 1 else None,  # the scheduler's lowest class
        flush=lambda: state.ledger.flush(timeout=30.0), runner_id=runner_id, previous_run=previous,
    )
    try:  # before the server is ready (the rounds try again if it fails): no row owed waits for a round
        await asyncio.wait_for(state.batch_runner.sweep(), START_SWEEP_SECONDS)
    except Exception as exc:
        log.warning("batch runner: the previous run's admitted lines were not swept at the start (%s); the rounds will",
                    type(exc).__name__)
    state.batch_runner.start()


async def stop(app: Any) -> None:
    runner = app.state.batch_runner
    if runner is not None:
        await runner.stop(timeout=min(app.state.settings.http.drain_seconds, 10.0))
