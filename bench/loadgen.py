"""A small keep-alive HTTP/1.1 load generator (asyncio + uvloop): N connections, each sending the
same request back to back for a duration; per-request latencies in seconds.

Handles Content-Length and chunked responses, so streamed (SSE) replies are read to the end.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    wall: float = 0.0

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall if self.wall else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies) if self.latencies else float("nan")


def build_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"host: {host}:{port}", "content-type: application/json",
             f"content-length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return status
    marker = lower.find(b"content-length:")
    if marker >= 0:
        end = lower.find(b"\r\n", marker)
        await reader.readexactly(int(lower[marker + 15 : end].strip()))
    return status


async def _worker(host: str, port: int, request: bytes, deadline: float, result: Result) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            writer.write(request)
            status = await _read_response(reader)
            result.latencies.append(time.perf_counter() - started)
            result.statuses[status] = result.statuses.get(status, 0) + 1
    finally:
        writer.close()


async def run(host: str, port: int, request: bytes, connections: int, seconds: float) -> Result:
    result = Result()
    started = time.perf_counter()
    deadline = started + seconds
    await asyncio.gather(*[_worker(host, port, request, deadline, result) for _ in range(connections)])
    result.wall = time.perf_counter() - started
    return result
