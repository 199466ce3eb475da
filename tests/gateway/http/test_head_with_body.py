"""gateway.http.hardening.HeadWithBody: a response head leaves in one send with the body's first bytes.

The transport under it here records writes (the end-to-end behaviour runs under every gateway test:
each response crosses it)."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.http.hardening import HeadWithBody


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n"


async def test_head_and_body_leave_in_one_write() -> None:
    raw = Recorder()
    t = HeadWithBody(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(HEAD)
    assert raw.writes == []
    t.write(b"{}")
    t.write(b"more")
    assert raw.writes == [HEAD + b"{}", b"more"]
    await asyncio.sleep(0)
    assert raw.writes == [HEAD + b"{}", b"more"]  # nothing left to flush
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the transport's


async def test_a_head_alone_goes_out_on_the_next_loop_turn_or_at_close() -> None:
    raw = Recorder()
    t = HeadWithBody(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(HEAD)
    await asyncio.sleep(0)
    assert raw.writes == [HEAD]
    t.write(b"late body")
    assert raw.writes == [HEAD, b"late body"]

    raw = Recorder()
    t = HeadWithBody(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(HEAD + b"whole refusal")  # a 408/431 written at once, then the connection closed
    t.close()
    assert raw.writes == [HEAD + b"whole refusal"] and raw.closed
    await asyncio.sleep(0)
    assert raw.writes == [HEAD + b"whole refusal"]  # not written twice


async def test_abort_drops_a_held_head() -> None:
    raw = Recorder()
    t = HeadWithBody(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(HEAD)
    t.abort()
    await asyncio.sleep(0)
    assert raw.writes == [] and raw.aborted
