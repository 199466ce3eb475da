"""ConnectionWatch: what a response registers with the guarded protocol instead of a task waiting for
`http.disconnect` (the end-to-end disconnect tests are in test_disconnect.py and the pool's tests)."""

from __future__ import annotations

import logging

import pytest

from gateway.http.hardening import ConnectionWatch


def test_callbacks_run_once_when_the_connection_is_lost() -> None:
    watch = ConnectionWatch()
    calls: list[str] = []
    watch.on_lost(lambda: calls.append("a"))
    watch.on_lost(lambda: calls.append("b"))
    watch.fire()
    assert calls == ["a", "b"] and watch.lost
    watch.fire()  # nothing registered twice
    assert calls == ["a", "b"]
    watch.on_lost(lambda: calls.append("late"))  # lost before it registered: called at once
    assert calls == ["a", "b", "late"]


def test_forgotten_callbacks_do_not_run_and_a_failing_one_does_not_stop_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    watch = ConnectionWatch()
    calls: list[str] = []
    watch.on_lost(lambda: calls.append("done already"))
    watch.forget()  # the response completed
    watch.fire()
    assert calls == []

    watch = ConnectionWatch()
    watch.on_lost(lambda: 1 / 0)
    watch.on_lost(lambda: calls.append("second"))
    with caplog.at_level(logging.ERROR, logger="tollgate.hardening"):
        watch.fire()
    assert calls == ["second"] and "disconnect callback failed" in caplog.text
