"""``deepinfer serve``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over :class:`AsyncLLM`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream=true`` as
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET
/metrics`` (Prometheus text), ``GET /version``, ``GET /v1/kv_layout``, ``POST /v1/drain`` (stop
admission, then forward unfinished requests with their KV: ``LLMEngine.start_drain``; also
``kill -USR1``).

Every error is ``{"error": {"message", "type", "param", "code"}}``: 400 naming the bad field, 404
for an unknown model, 429 when the admission queue is full, 503 when the engine has failed. A
client that disconnects (streaming or not) has its request aborted and its KV blocks freed.
"""

# No "from __future__ import annotations": FastAPI reads the handlers' annotations as live objects.

import asyncio
import contextlib
import logging
import signal
import time

from deepinfer_core.serving.common import APIError, ServerState

logger = logging.getLogger("deepinfer.serving")


def _param(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) if parts else "body"


def build_app(state: ServerState):
    """The FastAPI application over a started :class:`ServerState`."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST

    from deepinfer_core.serving.chat_completions import create_chat_completion
    from deepinfer_core.serving.completions import create_completion
    from deepinfer_core.serving.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedField
    from deepinfer_core.version import CORE_API_VERSION

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.llm.attach()  # the engine's frames are read on this loop from now on
        loop = asyncio.get_running_loop()
        if state.llm.can_drain and hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` drains
            loop.add_signal_handler(signal.SIGUSR1, lambda: asyncio.ensure_future(state.llm.start_drain()))
        yield

    app = FastAPI(title="DeepInfer", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = state.llm.metrics

    def error_response(err: APIError) -> JSONResponse:
        if metrics is not None and err.status != 429:
            metrics.reject(err.status)
        headers = {"Retry-After": "1"} if err.status in (429, 503) else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(UnsupportedField)
    async def _unsupported(request: Request, exc: UnsupportedField):
        return error_response(APIError(400, str(exc), exc.param))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _param(tuple(first.get("loc", ())))
        if first.get("type") == "extra_forbidden":
            message = f"unknown field {param!r}"
        elif first.get("type") == "json_invalid":
            message, param = f"request body is not valid JSON: {first.get('msg')}", "body"
        else:
            message = f"{param}: {first.get('msg')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem(s))"
        return error_response(APIError(400, message, param))

    async def respond(result, request: Request):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def until_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def run(coro, request: Request):
        """The handler, cancelled (its requests aborted) if the client leaves before it answers."""
        task = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not task.done():
            task.cancel()
            return Response(status_code=499)
        return await respond(task.result(), request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await run(create_completion(state, body, time.perf_counter()), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await run(create_chat_completion(state, body, time.perf_counter()), request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "deepinfer", "root": state.model_path,
                                            "max_model_len": state.max_model_len}]}

    @app.get("/health")
    async def health():
        if state.llm.error is not None:
            return error_response(APIError(503, f"the engine failed: {state.llm.error}", code="engine_dead"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render() if metrics is not None else b"", media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/kv_layout")
    async def kv_layout():
        """The engine's block size and KV store record layout (``LLMEngine.kv_layout_info``), for a router."""
        if state.llm.kv_layout is None:
            return error_response(APIError(404, "this engine does not report its KV layout", code="not_found"))
        return state.llm.kv_layout

    @app.post("/v1/drain")
    async def drain(request: Request):
        """Stop admission; after ``grace_s`` (default: the engine's drain_grace_s) forward every
        unfinished request with its KV (finish_reason "forwarded", kv_transfer_params)."""
        body = await request.json() if await request.body() else {}
        try:
            await state.llm.start_drain(body.get("grace_s"))
        except (ValueError, AttributeError, RuntimeError) as exc:
            return error_response(APIError(400, str(exc), "grace_s"))
        return {"draining": True}

    @app.get("/version")
    async def version():
        return {"version": "0.1.0", "core_api_version": CORE_API_VERSION}

    return app


def make_state(llm, model_name: str | None, max_queue_len: int, chat_template: str | None = None,
               reasoning: bool = False) -> ServerState:
    """Wrap a started :class:`~deepinfer_core.serving.async_llm.AsyncLLM` for serving."""
    from deepinfer_core.serving.chat import ChatEncoder, ChatTemplateError
    from deepinfer_core.serving.metrics import ServingMetrics

    cfg = llm.config
    name = model_name or (cfg.model if cfg.model else "deepinfer-default")
    if llm.metrics is None:
        llm.metrics = ServingMetrics(name)
    encoder, chat_error = None, None
    try:
        encoder = ChatEncoder(llm.model_dir, llm.tokenizer, chat_template)
    except ChatTemplateError as exc:
        chat_error = str(exc)
        logger.warning("chat disabled: %s", exc)
    max_pending = cfg.max_num_seqs * max(cfg.dp, 1) + max_queue_len
    return ServerState(llm, name, str(llm.model_dir), llm.max_model_len, max_pending, encoder, chat_error, reasoning)


def serve(config: str | dict | None, overrides: dict, host: str, port: int, model_name: str | None = None,
          max_queue_len: int = 1024, chat_template: str | None = None, reasoning: bool = False,
          log_level: str = "warning") -> None:
    """Start the engine process for ``compose(config, **overrides)`` (the same config as
    ``LLM(config=config, **overrides)``), then serve until interrupted; stops the engine on exit."""
    import uvicorn

    from deepinfer_core.serving.async_llm import AsyncLLM

    llm = AsyncLLM.spawn(config, log_level=overrides.get("log_level"), **overrides)
    try:
        state = make_state(llm, model_name, max_queue_len, chat_template, reasoning)
        app = build_app(state)
        config_ = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False,
                                 timeout_graceful_shutdown=5)
        server = uvicorn.Server(config_)
        print(f"deepinfer serve: {state.model_name!r} on http://{host}:{port}/v1 (max {state.max_pending} requests "
              f"in flight; engine process {llm.engine_pid})", flush=True)
        server.run()
    finally:
        llm.shutdown()
