"""A minimal asyncio HTTP/1.1 client for JSON requests between the router and engine servers."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit


class EngineHTTPError(RuntimeError):
    def __init__(self, status: int, body: dict | str, url: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {body}")
        self.status, self.body, self.url = status, body, url


async def request_json(url: str, method: str = "POST", body: dict | None = None, timeout: float = 600.0) -> dict:
    """Send ``body`` as JSON and return the JSON reply; EngineHTTPError for a non-2xx status."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    data = json.dumps(body).encode() if body is not None else b""
    head = (f"{method} {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()

    async def exchange() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head + data)
            await writer.drain()
            status_line = await reader.readline()
            status = int(status_line.split()[1])
            length, chunked = None, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
                elif name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
                    chunked = True
            if chunked:
                payload = b""
                while (size := int((await reader.readline()).strip() or b"0", 16)):
                    payload += await reader.readexactly(size)
                    await reader.readline()
            else:
                payload = await (reader.readexactly(length) if length is not None else reader.read())
            return status, payload
        finally:
            writer.close()

    status, payload = await asyncio.wait_for(exchange(), timeout)
    try:
        reply = json.loads(payload) if payload else {}
    except ValueError:
        reply = payload.decode("utf-8", "replace")
    if not 200 <= status < 300:
        raise EngineHTTPError(status, reply, url)
    return reply
