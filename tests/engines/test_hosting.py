"""An engine host's sends to its gateway workers (engines/hosting.py:WorkerSender), through the
real host of `tollgate serve --workers N` (gateway/serving/engine_hosts.py) over the `synthetic`
engine: a worker that stops reading holds up neither the engine nor another worker's streams;
and the sender alone: one that falls too far behind is cut off."""

from __future__ import annotations

import time
from multiprocessing import Pipe
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

import pytest

from engines import hosting
from engines.hosting import WorkerSender, joined
from gateway.config import Settings
from gateway.serving.engine_hosts import EngineHosts

# A fast engine with long outputs: a worker that does not read fills its socket's buffer within
# a second or so, and with a blocking send the host's loop would stop there for every worker.
MODELS = "models:\n  - id: synth\n    backend: synthetic\n    step_ms: 1\n    tokens_per_step: 64\n    max_batch_size: 16\n    context_length: 1000000\n"


@pytest.fixture
def host_socket(tmp_path: Path) -> Any:
    models = tmp_path / "models.yaml"
    models.write_text(MODELS)
    (tmp_path / "data").mkdir()
    hosts = EngineHosts(Settings(data_dir=tmp_path / "data").with_overrides(engines={"models_file": str(models)}))
    sockets = hosts.start()
    try:
        yield sockets["synth"]
    finally:
        hosts.stop()


def connect(path: str) -> Any:
    conn = Client(path, "AF_UNIX")
    assert conn.recv()[0] == "ready"
    return conn


def add(conn: Any, rid: str, max_tokens: int) -> None:
    conn.send(("add", rid, [1, 2, 3], max_tokens, 1.0, 1.0, None, None, None))


def read_until_done(conn: Any, rid: str, deadline: float) -> int:
    """Tokens the host sent for `rid` until its last output; fails at `deadline`."""
    tokens = 0
    while time.monotonic() < deadline:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            break
        message = conn.recv()
        if isinstance(message, tuple):
            continue  # ("held", ...) and the like
        for item_rid, ids, done, error, _queue_ms in message:
            if item_rid == rid:
                assert error is None
                tokens += len(ids)
                if done:
                    return tokens
    raise AssertionError(f"{rid} did not end in time: {tokens} tokens so far")


def test_a_worker_that_stops_reading_does_not_hold_up_another_workers_stream(host_socket: str) -> None:
    stalled, reading = connect(host_socket), connect(host_socket)
    try:
        for i in range(8):  # ~500k tokens/s for the stalled worker, which never reads a byte
            add(stalled, f"s{i}", 900_000)
        # Its buffer fills while this worker's requests run one after another, each to its end.
        deadline = time.monotonic() + 60
        for i in range(5):
            add(reading, f"r{i}", 20_000)
            assert read_until_done(reading, f"r{i}", deadline) == 20_000
    finally:
        stalled.close()
        reading.close()


def test_a_worker_too_far_behind_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sender alone (the host runs in its own process): a duplex pipe whose far end never reads.
    # Cut off, the connection is shut down, so the host's reader of it ends and drop_worker cancels
    # that worker's requests, as for a worker that died.
    monkeypatch.setattr(hosting, "MAX_BEHIND", 50)
    ours, theirs = Pipe()
    sender = WorkerSender(ours, "test-send")
    step = [("r", list(range(1000)), False, None, None)]
    for _ in range(100_000):
        sender.send(step)
        if sender.cut_off:
            break
    assert sender.cut_off, "a worker that never reads was never cut off"
    with pytest.raises((EOFError, OSError)):  # what was in its buffer, then the end: no hang
        while theirs.poll(30):
            theirs.recv()
    ours.close()
    theirs.close()


def test_joined_keeps_order_and_joins_consecutive_output_lists() -> None:
    assert joined([[1], [2, 3], ("held", 1, 0), [4], [5]]) == [[1, 2, 3], ("held", 1, 0), [4, 5]]
    assert joined([]) == []
