"""The router's HTTP API: ``POST /v1/completions`` through a prefill then a decode engine.

For each request: tokenize (so every engine and the prefix match see the same ids), ask the KV
store how much of the prompt is cached (metadata only), send it to the prefill engine with the
fewest uncached tokens in flight, then pass the returned ``kv_transfer_params`` to the decode
engine with the fewest running requests. A decode engine that answers ``finish_reason ==
"forwarded"`` (it is draining) handed the request's state off: the router sends it on to another
decode engine, which continues from that KV. Non-streaming, one prompt and one completion per
request (``n = 1``); the engines' errors are passed through with their status.

    deepinfer router --prefill http://p1:8001 http://p2:8002 --decode http://d1:8101 http://d2:8102 \\
        --config deepinfer.toml      # the engines' model, block_size and [kv_store] (for the match)
"""

# No "from __future__ import annotations": FastAPI reads the handlers' annotations as live objects.

import logging
import time
import uuid

from deepinfer_core.router.balance import DecodeBalancer, PrefillBalancer
from deepinfer_core.router.client import EngineHTTPError, request_json
from deepinfer_core.router.prefix import PrefixMatcher

logger = logging.getLogger("deepinfer.router")
MAX_FORWARDS = 8


class Router:
    """Routing state; ``tokenizer``: the engines' (``HFTokenizer``); ``make_matcher(layout info)``:
    the store match, built once the first prefill engine told its KV layout."""

    def __init__(self, prefill: list[str], decode: list[str], tokenizer, make_matcher) -> None:
        self.prefill, self.decode = PrefillBalancer(list(prefill)), DecodeBalancer(list(decode))
        self.tokenizer, self.make_matcher = tokenizer, make_matcher
        self.matcher: PrefixMatcher | None = None
        self.counts = {"requests": 0, "forwarded": 0, "prefix_cached_tokens": 0, "prompt_tokens": 0}

    def prompt_ids(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, str):
            return self.tokenizer.encode(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return list(p)
        raise ValueError("the router takes one prompt per request: a string or a list of token ids")

    async def complete(self, body: dict) -> dict:
        if body.get("stream") or body.get("n", 1) != 1 or body.get("best_of") not in (None, 1):
            raise ValueError("the router serves non-streaming requests with n = 1")
        ids = self.prompt_ids(body)
        if self.matcher is None:
            self.matcher = self.make_matcher(await request_json(self.prefill.urls[0] + "/v1/kv_layout", "GET"))
        cached = self.matcher.cached_tokens(ids)
        uncached = len(ids) - cached
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += len(ids)
        self.counts["prefix_cached_tokens"] += cached
        body = {**body, "prompt": ids}
        url = self.prefill.pick(uncached)
        try:
            first = await request_json(url + "/v1/completions", body=body)
        finally:
            self.prefill.done(url, uncached)
        transfer = first.get("kv_transfer_params")
        if transfer is None and (first["choices"][0]["finish_reason"] != "length" or body.get("max_tokens", 16) == 1):
            return first  # finished at its first token
        kv = len(ids) + int(body.get("max_tokens") or 16)
        exclude = None
        for _ in range(MAX_FORWARDS):
            url = self.decode.pick(1, kv, exclude=exclude)
            try:
                out = await request_json(url + "/v1/completions", body={**body, "kv_transfer_params": transfer})
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

    def stats(self) -> dict:
        return {**self.counts, "prefill": self.prefill.ratios(), "decode": self.decode.ratios()}


def build_app(router: Router):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="deepinfer router")

    def error(status: int, message: str, code: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "router_error", "param": None, "code": code}},
                            status_code=status)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
            out = await router.complete(body)
        except EngineHTTPError as exc:
            return JSONResponse(exc.body if isinstance(exc.body, dict) else {"error": {"message": str(exc)}},
                                status_code=exc.status)
        except (ValueError, TypeError) as exc:
            return error(400, str(exc), "bad_request")
        except (OSError, RuntimeError) as exc:
            logger.exception("routing failed")
            return error(502, f"{type(exc).__name__}: {exc}", "engine_unreachable")
        out["id"] = f"cmpl-{uuid.uuid4().hex}"
        out["created"] = int(time.time())
        return out

    @app.get("/router/stats")
    async def stats():
        return router.stats()

    @app.get("/health")
    async def health():
        return {}

    return app
