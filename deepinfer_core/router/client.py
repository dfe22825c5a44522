"""A minimal asyncio HTTP/1.1 client for JSON requests between the router and engine servers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
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


async def stream_events(url: str, body: dict, timeout: float = 600.0) -> AsyncIterator[str]:
    """POST ``body`` and yield the ``data:`` payload of each server-sent event as it arrives;
    EngineHTTPError (before any event) for a non-2xx status. Closing the generator closes the
    connection, which makes the engine abort the request."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    data = json.dumps(body).encode()
    head = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(data)}\r\n\r\n")
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(head.encode() + data)
        await writer.drain()
        status = int((await asyncio.wait_for(reader.readline(), timeout)).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
                chunked = True

        async def pieces() -> AsyncIterator[bytes]:
            if not chunked:
                while piece := await asyncio.wait_for(reader.read(65536), timeout):
                    yield piece
                return
            while size := int((await asyncio.wait_for(reader.readline(), timeout)).strip() or b"0", 16):
                yield await reader.readexactly(size)
                await reader.readline()

        if not 200 <= status < 300:
            payload = b"".join([p async for p in pieces()])
            try:
                raise EngineHTTPError(status, json.loads(payload), url)
            except ValueError:
                raise EngineHTTPError(status, payload.decode("utf-8", "replace"), url) from None
        buf = b""
        async for piece in pieces():
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.decode().splitlines():
                    if line.startswith("data:"):
                        yield line[5:].strip()
    finally:
        writer.close()
