"""The router's HTTP API: ``POST /v1/completions`` and ``/v1/chat/completions`` through a prefill
then a decode engine.

For each prompt: tokenize (so every engine and the prefix match see the same ids), ask the KV
store how much of it is cached (metadata only), send it to the prefill engine with the fewest
uncached tokens in flight, then pass the returned ``kv_transfer_params`` to the decode engine with
the fewest running requests (``decode.py``). Chat requests go to the engines' own
``/v1/chat/completions`` (one chat encoder: the engines'); the router renders the prompt with the
same encoder only to weigh it for the Prefill LB.

The OpenAI API is the colocated server's:

* ``n`` / ``best_of``: the prefill engine computes the prompt once and samples child 0's first
  token (seed ``seed + 0``); the decode engine receives that state as child 0 and forks the other
  samples from its prompt blocks (``engine/sample_group.py``), so the choices equal a colocated
  engine's for the same seed.
* A list of prompts: each is its own P/D request, its choices at ``index = prompt * n + sample``.
* Whole or streamed (``stream = true``: the prefill leg is whole, the decode leg is relayed as SSE).

A completion forwarded by a draining decode engine continues on another one (``decode.py``);
hostile ``n`` / ``best_of`` / ``seed`` / ``prompt`` values are 400s naming the field before any
engine is asked. The engines' errors are passed through with their status.

    deepinfer router --prefill http://p1:8001 http://p2:8002 --decode http://d1:8101 http://d2:8102 \\
        --config deepinfer.toml      # the engines' model, block_size and [kv_store] (for the match)
"""

# No "from __future__ import annotations": FastAPI reads the handlers' annotations as live objects.

import asyncio
import logging
import time
import uuid

from deepinfer_core.router.balance import DecodeBalancer, PrefillBalancer
from deepinfer_core.router.client import EngineHTTPError, request_json
from deepinfer_core.router.decode import DecodeLegs, PromptLeg
from deepinfer_core.router.prefix import PrefixMatcher

logger = logging.getLogger("deepinfer.router")
MAX_SAMPLES = 128  # n and best_of at most: the engines' cap (serving/protocol.py)


class BadField(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_samples(body: dict) -> tuple[int, int | None]:
    """(n, best_of) of a request; BadField naming the field for a value the engines would refuse."""
    n, best_of = body.get("n", 1), body.get("best_of")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_SAMPLES:
        raise BadField("n", f"n must be an int in [1, {MAX_SAMPLES}], got {n!r}")
    if best_of is not None:
        if not _is_int(best_of) or not n <= best_of <= MAX_SAMPLES:
            raise BadField("best_of", f"best_of must be an int in [n={n}, {MAX_SAMPLES}], got {best_of!r}")
        if best_of > n and body.get("stream"):
            raise BadField("best_of", "best_of > n cannot be streamed (the best completions are known only at "
                                      "the end)")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadField("seed", f"seed must be an int, got {seed!r}")
    for key in ("kv_transfer_params", "pd_accounting"):
        if body.get(key) is not None:
            raise BadField(key, f"{key} is set by the router for its engines, not by a client")
    return n, best_of


class Router:
    """Routing state; ``tokenizer``: the engines' (``HFTokenizer``); ``make_matcher(layout info)``:
    the store match, built once the first prefill engine told its KV layout; ``chat_encoder``: the
    serving ``ChatEncoder`` of the engines' model (None: the model cannot chat); ``vocab_size``: the
    model's (prompt ids are checked against it before any engine is asked)."""

    def __init__(self, prefill: list[str], decode: list[str], tokenizer, make_matcher, chat_encoder=None,
                 vocab_size: int | None = None) -> None:
        self.prefill, self.decode = PrefillBalancer(list(prefill)), DecodeBalancer(list(decode))
        self.tokenizer, self.make_matcher, self.chat_encoder = tokenizer, make_matcher, chat_encoder
        self.vocab_size = vocab_size
        self.matcher: PrefixMatcher | None = None
        self.max_model_len: int | None = None
        self.counts = {"requests": 0, "forwarded": 0, "prefix_cached_tokens": 0, "prompt_tokens": 0,
                       "forwarded_streams": 0}
        self.legs = DecodeLegs(self)

    def prompts(self, body: dict, chat: bool) -> list[list[int]]:
        """The prompts' token ids as the engines see them (a chat request has one)."""
        if chat:
            return [self.chat_ids(body)]
        p = body.get("prompt")
        if isinstance(p, str):
            return [self.tokenizer.encode(p)]
        if isinstance(p, list) and p and all(_is_int(t) for t in p):
            return [list(p)]
        if not isinstance(p, list) or not p:
            raise BadField("prompt", "prompt must be a string, a list of token ids, or a non-empty list of "
                                     f"those, got {type(p).__name__} {str(p)[:80]}")
        out = []
        for i, x in enumerate(p):
            if isinstance(x, str):
                out.append(self.tokenizer.encode(x))
            elif isinstance(x, list) and x and all(_is_int(t) for t in x):
                out.append(list(x))
            else:
                raise BadField("prompt", f"prompt[{i}] must be a string or a non-empty list of token ids, got "
                                         f"{type(x).__name__} {str(x)[:80]}")
        return out

    def check_ids(self, prompts: list[list[int]]) -> None:
        many = len(prompts) > 1
        for i, ids in enumerate(prompts):
            where = f"prompt[{i}]" if many else "prompt"
            if not ids:
                raise BadField("prompt", f"{where} is empty")
            bad = next((t for t in ids if not 0 <= t < (self.vocab_size or 1 << 62)), None)
            if bad is not None:
                raise BadField("prompt", f"{where} has token id {bad}, outside the vocabulary [0, {self.vocab_size})")
            if self.max_model_len is not None and len(ids) >= self.max_model_len:
                raise BadField("prompt", f"{where} has {len(ids)} tokens; the model's maximum length is "
                                         f"{self.max_model_len} (prompt plus at least one generated token)")

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

    async def prefill_legs(self, path: str, body: dict, chat: bool) -> list[PromptLeg]:
        """Every prompt through a prefill engine (the first alone, so a request the engines refuse fails
        before the others start), as the decode side's ``PromptLeg``s."""
        n, best_of = check_samples(body)
        if self.matcher is None:
            url = self.prefill.urls[0]
            self.matcher = self.make_matcher(await request_json(url + "/v1/kv_layout", "GET"))
            models = await request_json(url + "/v1/models", "GET")
            self.max_model_len = (models.get("data") or [{}])[0].get("max_model_len")
        prompts = self.prompts(body, chat)
        self.check_ids(prompts)
        # one sample on the prefill engine: child 0 (seed + 0), whose state the decode engine forks
        one = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of")}
        first = [await self.prefill_leg(path, one, chat, prompts[0])]
        first += await asyncio.gather(*(self.prefill_leg(path, one, chat, ids) for ids in prompts[1:]))
        return [PromptLeg(i, n, best_of, body if chat else {**body, "prompt": ids}, reply)
                for i, (ids, reply) in enumerate(zip(prompts, first))]

    async def prefill_leg(self, path: str, one: dict, chat: bool, ids: list[int]) -> dict:
        """The prefill engine's whole reply for one prompt (one sample)."""
        cached = self.matcher.cached_tokens(ids)
        uncached = len(ids) - cached
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += len(ids)
        self.counts["prefix_cached_tokens"] += cached
        url = self.prefill.pick(uncached)
        try:
            return await request_json(url + path, body=one if chat else {**one, "prompt": ids})
        finally:
            self.prefill.done(url, uncached)

    def stats(self) -> dict:
        return {**self.counts, "prefill": self.prefill.ratios(), "decode": self.decode.ratios()}


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
            legs = await router.prefill_legs(path, body, chat)  # before the response starts: errors keep status
            if body.get("stream"):
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return StreamingResponse(router.legs.stream(path, legs, rid, chat, usage),
                                         media_type="text/event-stream")
            out = await router.legs.whole(path, legs, chat)
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
        return {"id": rid, "created": int(time.time()), **out}

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
