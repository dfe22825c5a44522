"""The router's HTTP API: ``POST /v1/completions`` and ``/v1/chat/completions`` through a prefill
then a decode engine.

For each request: tokenize (so every engine and the prefix match see the same ids), ask the KV
store how much of the prompt is cached (metadata only), send it to the prefill engine with the
fewest uncached tokens in flight, then pass the returned ``kv_transfer_params`` to the decode
engine with the fewest running requests. A decode engine that answers ``finish_reason ==
"forwarded"`` (it is draining) handed the request's state off: the router sends it on to another
decode engine, which continues from that KV. With ``stream = true`` the prefill leg is still
whole (it returns ``kv_transfer_params``) and the decode leg is streamed and relayed as SSE
(``relay.py``), continued on the next decode engine after a forward; a client that leaves closes
the decode engine's connection, which aborts the request there. Chat requests go to the engines'
own ``/v1/chat/completions`` (one chat encoder: the engines'); the router renders the prompt with
the same encoder only to weigh it for the Prefill LB. One prompt and one completion per request:
``n``/``best_of`` > 1 and list prompts are refused (400 naming the field), since one hand-off
carries one sequence. The engines' errors are passed through with their status.

    deepinfer router --prefill http://p1:8001 http://p2:8002 --decode http://d1:8101 http://d2:8102 \\
        --config deepinfer.toml      # the engines' model, block_size and [kv_store] (for the match)
"""

# No "from __future__ import annotations": FastAPI reads the handlers' annotations as live objects.

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from deepinfer_core.router.balance import DecodeBalancer, PrefillBalancer
from deepinfer_core.router.client import EngineHTTPError, request_json, stream_events
from deepinfer_core.router.prefix import PrefixMatcher
from deepinfer_core.router.relay import Relay, forwarded

logger = logging.getLogger("deepinfer.router")
MAX_FORWARDS = 8


class BadField(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Router:
    """Routing state; ``tokenizer``: the engines' (``HFTokenizer``); ``make_matcher(layout info)``:
    the store match, built once the first prefill engine told its KV layout; ``chat_encoder``: the
    serving ``ChatEncoder`` of the engines' model (None: the model cannot chat)."""

    def __init__(self, prefill: list[str], decode: list[str], tokenizer, make_matcher, chat_encoder=None) -> None:
        self.prefill, self.decode = PrefillBalancer(list(prefill)), DecodeBalancer(list(decode))
        self.tokenizer, self.make_matcher, self.chat_encoder = tokenizer, make_matcher, chat_encoder
        self.matcher: PrefixMatcher | None = None
        self.counts = {"requests": 0, "forwarded": 0, "prefix_cached_tokens": 0, "prompt_tokens": 0,
                       "forwarded_streams": 0}

    def prompt_ids(self, body: dict, chat: bool) -> list[int]:
        """The prompt's token ids as the engines see them (checks one prompt, one completion)."""
        if body.get("n", 1) not in (None, 1):
            raise BadField("n", "the router serves n = 1 only (one KV hand-off carries one sequence); send n "
                                "requests")
        if body.get("best_of") not in (None, 1):
            raise BadField("best_of", "the router serves best_of = 1 only (one KV hand-off carries one sequence)")
        if chat:
            return self.chat_ids(body)
        p = body.get("prompt")
        if isinstance(p, str):
            return self.tokenizer.encode(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return list(p)
        raise BadField("prompt", "the router takes one prompt per request: a string or a list of token ids "
                                 "(send a list of prompts as separate requests)")

    def chat_ids(self, body: dict) -> list[int]:
        from pydantic import ValidationError

        from deepinfer_core.serving.chat import ChatTemplateError
        from deepinfer_core.serving.protocol import ChatCompletionRequest

        if self.chat_encoder is None:
            raise BadField("messages", "this model cannot chat (no chat template)")
        try:
            req = ChatCompletionRequest(**body)
            return self.chat_encoder.encode(req.message_dicts(), add_generation_prompt=req.add_generation_prompt,
                                            tools=req.tool_dicts(), **(req.chat_template_kwargs or {}))
        except (ValidationError, ChatTemplateError) as exc:
            raise BadField("messages", str(exc)) from exc

    async def prefill_leg(self, path: str, body: dict, chat: bool) -> tuple[dict, dict]:
        """(body for the decode leg, the prefill engine's whole reply)."""
        ids = self.prompt_ids(body, chat)
        if self.matcher is None:
            self.matcher = self.make_matcher(await request_json(self.prefill.urls[0] + "/v1/kv_layout", "GET"))
        cached = self.matcher.cached_tokens(ids)
        uncached = len(ids) - cached
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += len(ids)
        self.counts["prefix_cached_tokens"] += cached
        if not chat:
            body = {**body, "prompt": ids}
        url = self.prefill.pick(uncached)
        try:
            whole = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            first = await request_json(url + path, body=whole)
        finally:
            self.prefill.done(url, uncached)
        return body, first

    def kv_tokens(self, body: dict, first: dict) -> int:
        return first["usage"]["prompt_tokens"] + int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)

    @staticmethod
    def finished_at_first(body: dict, first: dict) -> bool:
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        return first.get("kv_transfer_params") is None and (first["choices"][0]["finish_reason"] != "length"
                                                            or limit == 1)

    async def complete(self, path: str, body: dict, chat: bool) -> dict:
        body, first = await self.prefill_leg(path, body, chat)
        if self.finished_at_first(body, first):
            return first
        transfer, kv, exclude = first.get("kv_transfer_params"), self.kv_tokens(body, first), None
        for _ in range(MAX_FORWARDS):
            url = self.decode.pick(1, kv, exclude=exclude)
            try:
                out = await request_json(url + path, body={**body, "kv_transfer_params": transfer})
            except EngineHTTPError as exc:
                if exc.status != 503:
                    raise
                self.decode.engine(url).draining = True  # draining or dead: try another decode engine
                exclude = url
                continue
            finally:
                self.decode.done(url, 1, kv)
            if out["choices"][0]["finish_reason"] != "forwarded":
                return out
            self.counts["forwarded"] += 1
            self.decode.engine(url).draining = True
            transfer, exclude = out.get("kv_transfer_params"), url
        raise RuntimeError(f"request forwarded {MAX_FORWARDS} times without finishing")

    async def stream(self, path: str, body: dict, first: dict, rid: str) -> AsyncIterator[str]:
        """SSE frames of the decode leg(s), after ``prefill_leg`` returned (``body``, ``first``)."""
        if self.finished_at_first(body, first):
            for frame in whole_as_frames(first, body, rid):
                yield sse(frame)
            yield sse("[DONE]")
            return
        transfer, kv, exclude, relay = first.get("kv_transfer_params"), self.kv_tokens(body, first), None, Relay()
        try:
            for _ in range(MAX_FORWARDS):
                url, handed = self.decode.pick(1, kv, exclude=exclude), None
                relay.next_engine()
                events = stream_events(url + path, {**body, "stream": True, "kv_transfer_params": transfer})
                try:
                    async for data in events:
                        if data == "[DONE]":
                            break
                        frame = json.loads(data)
                        if handed is not None:
                            continue  # the forwarded leg's usage: the next engine's counts all tokens
                        if forwarded(frame):
                            handed = frame.get("kv_transfer_params") or {}
                            continue
                        if "error" not in frame:
                            frame = relay.frame({**frame, "id": rid})
                        if frame is not None:
                            yield sse(frame)
                except EngineHTTPError as exc:
                    if exc.status != 503:
                        raise
                    self.decode.engine(url).draining = True
                    exclude = url
                    continue
                finally:
                    await events.aclose()  # a client that left: the engine sees the connection close
                    self.decode.done(url, 1, kv)
                if handed is None:
                    yield sse("[DONE]")
                    return
                self.counts["forwarded"] += 1
                self.counts["forwarded_streams"] += 1
                self.decode.engine(url).draining = True
                transfer, exclude = handed, url
            raise RuntimeError(f"request forwarded {MAX_FORWARDS} times without finishing")
        except (EngineHTTPError, OSError, RuntimeError, ValueError) as exc:  # the status is sent: report in-stream
            logger.exception("streaming failed")
            body = exc.body if isinstance(exc, EngineHTTPError) and isinstance(exc.body, dict) else \
                {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "router_error", "code": "engine_error"}}
            yield sse(body)
            yield sse("[DONE]")

    def stats(self) -> dict:
        return {**self.counts, "prefill": self.prefill.ratios(), "decode": self.decode.ratios()}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def whole_as_frames(out: dict, body: dict, rid: str) -> list[dict]:
    """A whole reply (a request that finished at its prefill token) as the frames of a stream."""
    head = {"id": rid, "created": out.get("created", int(time.time())), "model": out.get("model")}
    frames = []
    for c in out["choices"]:
        if "message" in c:
            head["object"] = "chat.completion.chunk"
            delta = {k: v for k, v in c["message"].items() if v is not None}
            frames.append({**head, "choices": [{"index": c["index"], "delta": delta, "logprobs": c.get("logprobs"),
                                                "finish_reason": c["finish_reason"]}]})
        else:
            head["object"] = "text_completion"
            frames.append({**head, "choices": [{"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                                                "finish_reason": c["finish_reason"]}]})
    if (body.get("stream_options") or {}).get("include_usage"):
        frames.append({**head, "choices": [], "usage": out["usage"]})
    return frames


def build_app(router: Router):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="deepinfer router")

    def error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status == 400
                                       else "router_error", "param": param, "code": code}}, status_code=status)

    async def route(request: Request, path: str, chat: bool):
        from fastapi.responses import StreamingResponse

        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadField("body", "the request body must be a JSON object")
            if body.get("stream"):  # the prefill leg before the response starts: its errors keep their status
                body, first = await router.prefill_leg(path, body, chat)
                return StreamingResponse(router.stream(path, body, first, rid), media_type="text/event-stream")
            out = await router.complete(path, body, chat)
        except EngineHTTPError as exc:
            return JSONResponse(exc.body if isinstance(exc.body, dict) else {"error": {"message": str(exc)}},
                                status_code=exc.status)
        except BadField as exc:
            return error(400, str(exc), "bad_request", exc.param)
        except (ValueError, TypeError) as exc:
            return error(400, str(exc), "bad_request")
        except (OSError, RuntimeError) as exc:
            logger.exception("routing failed")
            return error(502, f"{type(exc).__name__}: {exc}", "engine_unreachable")
        out.pop("kv_transfer_params", None)
        out["id"] = rid
        out["created"] = int(time.time())
        return out

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await route(request, "/v1/chat/completions", chat=True)

    @app.get("/router/stats")
    async def stats():
        return router.stats()

    @app.get("/health")
    async def health():
        return {}

    return app
