"""What both OpenAI endpoints share: the server state, errors, admission, SSE framing, usage."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deepinfer_core.engine.engine import EngineDrainingError
from deepinfer_core.serving.async_llm import AsyncLLM, EngineDeadError, RequestStream, RequestUpdate


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
             500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"), "param": self.param,
                          "code": self.code or self.status}}


@dataclass
class ServerState:
    llm: AsyncLLM
    model_name: str
    model_path: str
    max_model_len: int
    max_pending: int  # requests admitted and unfinished, at most (running batch + admission queue)
    chat_encoder: object | None = None  # ChatEncoder, or None when the model has no chat template
    chat_error: str | None = None  # why there is no chat encoder
    reasoning: bool = False  # split <think>...</think> into reasoning_content
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model",
                           "model_not_found")

    def admit(self, count: int) -> None:
        """429 when ``count`` more requests would overflow the admission queue; 503 if the engine died."""
        if self.llm.error is not None:
            raise APIError(503, f"the engine failed and cannot serve requests: {self.llm.error}", code="engine_dead")
        if self.llm.draining:
            raise APIError(503, "this engine is draining and takes no new requests", code="draining")
        if self.llm.num_unfinished + count > self.max_pending:
            if self.llm.metrics is not None:
                self.llm.metrics.reject(429)
            raise APIError(429, f"server is at capacity: {self.llm.num_unfinished} requests in flight, at most "
                                f"{self.max_pending} (max_num_seqs plus --max-queue-len); retry later",
                           code="queue_full")

    async def start(self, prompts: list, params, request_id: str, arrival: float) -> list[RequestStream]:
        """Queue one request per prompt; all or none (a bad one aborts the others and is a 400)."""
        self.admit(len(prompts) * params.num_samples)
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-p{i}"
                streams.append(await self.llm.add(prompt, params, rid, arrival))
        except EngineDeadError as exc:
            _abort(streams)
            raise APIError(503, str(exc), code="engine_dead") from exc
        except EngineDrainingError as exc:
            _abort(streams)
            raise APIError(503, str(exc), code="draining") from exc
        except (ValueError, TypeError) as exc:
            _abort(streams)
            raise bad_request(exc) from exc
        return streams


def _abort(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


def bad_request(exc: BaseException) -> APIError:
    """A 400 for the engine's ValueError/TypeError, naming the field its message names."""
    import re

    text = str(exc)
    m = re.search(r"SamplingParams\.(\w+)", text) or re.search(r"\b(so_args|prompt_token_ids|prompt)\b", text)
    param = m.group(1) if m else None
    param = {"so_args": "response_format", "prompt_token_ids": "prompt"}.get(param, param)
    return APIError(400, text, param)


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict | str) -> str:
    """One server-sent event frame."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestUpdate]]:
    """The updates of several request streams as they come, tagged with the stream's position."""
    import asyncio

    if len(streams) == 1:
        async for u in streams[0]:
            yield 0, u
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        async for u in s:
            await q.put((i, u))
        await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, u = await q.get()
            if u is None:
                left -= 1
            else:
                yield i, u
    finally:
        for t in tasks:
            t.cancel()
        _abort(streams)


async def live_updates(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestUpdate]]:
    """``merged(streams)`` until a request fails: then its error is raised as an APIError."""
    async for i, update in merged(streams):
        err = failed(update) if update.finished else None
        if err is not None:
            raise err
        yield i, update


def chunk_writer(rid: str, obj: str, model: str):
    """``chunk(choices, usage=None, **extra)``: one SSE frame of a streamed response of type ``obj``."""
    created = int(time.time())

    def chunk(choices: list[dict], use: dict | None = None, **extra) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
        if use is not None:
            body["usage"] = use
        return sse(body)

    return chunk


def handed_off(update: RequestUpdate) -> dict:
    """``{"kv_transfer_params": ...}`` for the last frame of a request whose state was handed off
    (a prefill engine's, or one forwarded by a draining engine): where a router continues it."""
    out = update.output if update.finished else None
    return {"kv_transfer_params": out.kv_transfer_params} if out is not None and out.kv_transfer_params else {}


def choice_extras(transfer: dict | None, accounting: bool, completion_tokens: int,
                  cumulative_logprob: float | None = None) -> dict:
    """A finished choice's P/D fields: ``kv_transfer_params`` of a completion forwarded by a drain (where
    it continues), and with ``pd_accounting`` (a router's leg) ``pd``: its token count and cumulative
    logprob, for the router's usage and best_of ranking across engines."""
    out: dict = {} if transfer is None else {"kv_transfer_params": transfer}
    if accounting:
        out["pd"] = {"completion_tokens": completion_tokens, "cumulative_logprob": cumulative_logprob}
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def failed(update: RequestUpdate) -> APIError | None:
    """The error to answer for a request that failed (None if it did not)."""
    err = update.error
    if err is None and update.output is None and update.finished:
        return APIError(503, "the request was aborted (server shutting down)", code="aborted")
    if err is None:
        return None
    if isinstance(err, EngineDeadError) or update.output is None:
        return APIError(503, f"the engine failed: {err}", code="engine_dead")
    if isinstance(err, (ValueError, TypeError)):
        return bad_request(err)
    return APIError(500, f"{type(err).__name__}: {err}")
