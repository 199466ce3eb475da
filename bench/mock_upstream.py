"""A fast OpenAI-compatible mock upstream for benchmarks: raw asyncio HTTP/1.1 with keep-alive.

POST .../chat/completions or .../completions -> a canned completion; with "stream": true, 16
content chunks, a finish chunk, a usage chunk and [DONE]. GET anything else -> 200 {}.

    python bench/mock_upstream.py --port 9100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

CHUNKS = int(os.environ.get("MOCK_CHUNKS", "16"))  # content chunks per streamed answer (the bench's default 16)
PROMPT_TOKENS = 12


def _completion(chat: bool) -> bytes:
    text = " ".join(f"w{i}" for i in range(CHUNKS))
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"} if chat else {
        "index": 0, "text": text, "finish_reason": "stop"}
    body = {
        "id": "mock-1", "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
        "model": "mock", "choices": [choice],
        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": CHUNKS, "total_tokens": PROMPT_TOKENS + CHUNKS},
    }
    return json.dumps(body).encode()


def _stream(chat: bool) -> bytes:
    obj = "chat.completion.chunk" if chat else "text_completion"
    out = []
    for i in range(CHUNKS):
        choice = {"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None} if chat else {
            "index": 0, "text": f" w{i}", "finish_reason": None}
        out.append({"id": "mock-1", "object": obj, "created": 0, "model": "mock", "choices": [choice]})
    last = {"index": 0, "delta": {}, "finish_reason": "stop"} if chat else {"index": 0, "text": "", "finish_reason": "stop"}
    out.append({"id": "mock-1", "object": obj, "created": 0, "model": "mock", "choices": [last]})
    out.append({"id": "mock-1", "object": obj, "created": 0, "model": "mock", "choices": [],
                "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": CHUNKS, "total_tokens": PROMPT_TOKENS + CHUNKS}})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in out) + b"data: [DONE]\n\n"


def _response(body: bytes, content_type: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


RESPONSES = {
    (True, False): _response(_completion(True), b"application/json"),
    (False, False): _response(_completion(False), b"application/json"),
    (True, True): _response(_stream(True), b"text/event-stream"),
    (False, True): _response(_stream(False), b"text/event-stream"),
}
OK = _response(b"{}", b"application/json")


class Upstream(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].lower()
            length = 0
            marker = head.find(b"content-length:")
            if marker >= 0:
                length = int(head[marker + 15 : head.find(b"\r\n", marker) if head.find(b"\r\n", marker) > 0 else None].strip())
            total = head_end + 4 + length
            if len(self.buffer) < total:
                return
            body = self.buffer[head_end + 4 : total]
            self.buffer = self.buffer[total:]
            if head.startswith(b"post"):
                chat = b"chat/completions" in head[:200]
                stream = b'"stream":true' in body.replace(b" ", b"")
                self.transport.write(RESPONSES[(chat, stream)])  # type: ignore[attr-defined]
            else:
                self.transport.write(OK)  # type: ignore[attr-defined]


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
