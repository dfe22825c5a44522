"""AsyncLLM: an asyncio front end over one engine core, for servers.

The engine runs in an :class:`~deepinfer_core.serving.engine_core.EngineCore` loop that alone calls
``add_request``, ``abort`` and ``step``, so the engine stays single-threaded exactly as under
``LLM.generate``. AsyncLLM talks to it over a socket in JSON frames (``serving/wire.py``): requests
and aborts in, one frame of per-request output deltas per step out.

``AsyncLLM.spawn(config, **overrides)`` (what ``deepinfer serve`` uses) runs the core in its own
process, as vLLM v1 runs its EngineCore: the engine's per-step Python work (scheduling, sampling
bookkeeping, detokenization) and the API process's HTTP/SSE work then never wait on one GIL, which
on a busy machine cost a quarter of the throughput when they shared one. With dp/ep > 1 the core
drives a :class:`~deepinfer_core.parallel.launcher.ParallelEngine` inside that process, unchanged.

``AsyncLLM(engine)`` runs the same core in a thread over an engine object already built in this
process, through the same socket and frames. It exists for callers that hold such an object, which
cannot cross a process boundary: tests that instrument the engine (count its steps, make a step
fail) and programs embedding an engine they configured themselves.

The event loop reads the frames itself (``loop.add_reader`` on the socket): no reader thread, so
no GIL hand-off between threads in the API process per step. It routes each update to its
:class:`RequestStream`. If the engine process dies, the socket reads EOF at once: every request
fails with :class:`EngineDeadError`, ``error`` is set (``/health`` then answers 503) and new
requests are refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from deepinfer_core.outputs import Logprob, RequestOutput
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.serving.wire import (
    Channel,
    error_from_wire,
    error_to_wire,
    logprobs_from_wire,
    output_from_wire,
    params_to_wire,
)

logger = logging.getLogger("deepinfer.serving")


class EngineDeadError(RuntimeError):
    """The engine failed; no request can be served."""


@dataclass
class CompletionDelta:
    """What one completion of a request added since the last update."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict | None = None  # finish_reason "forwarded": where this completion continues


@dataclass
class RequestUpdate:
    request_id: str
    deltas: list[CompletionDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    output: RequestOutput | None = None  # the final output (finished updates only)
    error: BaseException | None = None  # the request failed (finish_reason "error"), or the engine died


class RequestStream:
    """The updates of one request, consumed with ``async for`` on the event loop.

    Updates that arrive while the consumer is still busy with the previous one are merged into one
    (texts and tokens appended per completion), as vLLM v1's output collector does: a consumer that
    falls behind (a slow client, a busy machine) then handles one update, one SSE frame, for several
    engine steps instead of queueing a frame per step, so the HTTP work per token shrinks exactly when
    the CPU is short."""

    def __init__(self, owner: AsyncLLM, request_id: str, weight: int, arrival: float) -> None:
        self.owner, self.request_id = owner, request_id
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.finished = False
        self.weight = weight  # completions it draws (n / best_of): what it counts against the admission limit
        self.arrival = arrival
        self.token_times: dict[int, tuple[float, float]] = {}  # per completion: first and last token seen
        self._pending: RequestUpdate | None = None
        self._ready = asyncio.Event()

    def put(self, update: RequestUpdate) -> None:
        if self._pending is None:
            self._pending = update
            self._ready.set()
        else:
            _merge(self._pending, update)

    async def __aiter__(self) -> AsyncIterator[RequestUpdate]:
        try:
            while not self.finished:
                if self._pending is None:
                    self._ready.clear()
                    await self._ready.wait()
                update, self._pending = self._pending, None
                self.finished = update.finished
                yield update
        finally:
            if not self.finished:  # the consumer left early (client gone, cancelled)
                self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


def _merge(into: RequestUpdate, new: RequestUpdate) -> None:
    """Append ``new`` (a later update of the same request) to ``into``."""
    by_index = {d.index: d for d in into.deltas}
    for d in new.deltas:
        old = by_index.get(d.index)
        if old is None:
            into.deltas.append(d)
            by_index[d.index] = d
            continue
        old.text += d.text
        old.token_ids = old.token_ids + d.token_ids
        if d.logprobs is not None:
            old.logprobs = (old.logprobs or []) + d.logprobs
        old.finish_reason, old.stop_reason = d.finish_reason, d.stop_reason
    into.finished, into.num_prompt_tokens, into.num_cached_tokens = new.finished, new.num_prompt_tokens, \
        new.num_cached_tokens
    into.output, into.error = new.output, new.error


class AsyncLLM:
    """Add a request, then iterate its stream. ``AsyncLLM(engine)`` runs the core in a thread over an
    in-process engine; :meth:`spawn` runs it in its own process (see the module docstring).

    ``metrics``: an optional :class:`~deepinfer_core.serving.metrics.ServingMetrics`.
    ``sampling_defaults``: what ``params=None`` means (the checkpoint's generation_config.json).
    """

    def __init__(self, engine, metrics=None, sampling_defaults: dict | None = None) -> None:
        from deepinfer_core.serving.engine_core import EngineCore, engine_info

        ours, theirs = socket.socketpair()
        core = EngineCore(engine, Channel(theirs), sampling_defaults)
        self._engine, self._proc = engine, None
        self._core_thread = threading.Thread(target=self._run_core, args=(core, theirs), name="deepinfer-engine",
                                             daemon=True)
        self._setup(Channel(ours), engine.cfg, engine_info(engine), engine.tokenizer, metrics, sampling_defaults)
        self._core_thread.start()

    @staticmethod
    def _run_core(core, sock: socket.socket) -> None:
        try:
            core.run()
        finally:
            sock.close()

    @classmethod
    def spawn(cls, config: str | dict | None = None, metrics=None, log_level: str | None = None,
              **overrides) -> AsyncLLM:
        """An engine core in its own process, built from ``compose(config, **overrides)`` exactly as
        ``LLM(config=config, **overrides)`` builds its engine. A bad config raises here (ConfigError)
        before any process starts; an error building the engine (missing checkpoint, no accelerator)
        is raised again here with the same class and message."""
        from deepinfer_core.config import compose
        from deepinfer_core.engine.tokenizer import HFTokenizer
        from deepinfer_core.models.generation_config import sampling_defaults

        cfg = compose(config, **overrides)
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # Same session as the API process: with the kernel's per-session CPU groups (autogroup), an
        # engine in a session of its own served 20-30% fewer tok/s on the busy CPU box than in this one.
        # It ignores SIGINT (a terminal's Ctrl-C reaches the whole group); shutdown() stops it.
        proc = subprocess.Popen([sys.executable, "-m", "deepinfer_core.serving.engine_core", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        channel = Channel(ours)
        try:
            channel.send({"config": os.fspath(config) if isinstance(config, os.PathLike) else config,
                          "overrides": overrides, "log_level": log_level})
            try:
                first = channel.recv()[0]
            except (EOFError, OSError):
                _stop_process(proc, 10)
                raise RuntimeError(f"the engine process exited while starting ({_exit_text(proc)})") from None
            if first["t"] == "failed":  # the process says why and exits
                channel.close()
                _stop_process(proc, 30)
                raise error_from_wire(first["error"])
        except BaseException:
            if proc.poll() is None:  # interrupted while the engine was still being built
                proc.kill()
                proc.wait()
            channel.close()
            raise
        info = first["info"]
        self = cls.__new__(cls)
        self._engine, self._proc, self._core_thread = None, proc, None
        model_dir = Path(info["model_dir"])
        tokenizer = HFTokenizer.load(model_dir, info["bos_token_id"], info["eos_token_id"])
        self._setup(channel, cfg, info, tokenizer, metrics, sampling_defaults(model_dir))
        return self

    def _setup(self, channel: Channel, cfg, info: dict, tokenizer, metrics, sampling_defaults: dict | None) -> None:
        self.config = cfg
        self.kv_layout: dict | None = info.get("kv_layout")  # LLMEngine.kv_layout_info(), for a router
        self.can_drain: bool = info.get("can_drain", False)  # a [kv_transfer] to forward requests through
        self.draining = False
        self._drains: list[asyncio.Future] = []
        self.model_dir = Path(info["model_dir"])
        self.max_model_len = info["max_model_len"]
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.sampling_defaults = dict(sampling_defaults or {})
        self.error: BaseException | None = None
        self.num_unfinished = 0  # completions (n per request) added and not yet finished (event-loop side)
        self._channel = channel
        self._send_lock = threading.Lock()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event-loop side

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None when the core runs in a thread)."""
        return None if self._proc is None else self._proc.pid

    # ---- event-loop side ------------------------------------------------------------------
    async def add(self, prompt, params: SamplingParams | dict | None = None,
                  request_id: str | None = None, arrival: float | None = None) -> RequestStream:
        """Queue a request. Raises the engine's ValueError/TypeError for bad input (before any
        output), :class:`EngineDeadError` if the engine failed."""
        self._check_alive()
        self.attach()
        request_id = request_id or uuid.uuid4().hex
        weight = params.num_samples if isinstance(params, SamplingParams) else 1
        stream = RequestStream(self, request_id, weight, arrival or time.perf_counter())
        self._streams[request_id] = stream
        self.num_unfinished += weight
        self._send(["add", request_id, prompt, params_to_wire(params)])
        try:
            await stream.accepted
        except asyncio.CancelledError:  # the caller left while the request was being queued
            stream.abort()  # its abort (or rejection) frame settles num_unfinished
            raise
        except BaseException:
            stream.finished = True
            raise
        return stream

    async def generate(self, prompt, params: SamplingParams | dict | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """The final output of one request."""
        stream = await self.add(prompt, params, request_id)
        async for update in stream:
            if update.finished:
                if update.error is not None and update.output is None:
                    raise EngineDeadError(f"the engine failed: {update.error}") from update.error
                return update.output
        raise EngineDeadError("request stream ended without an output")

    async def start_drain(self, grace_s: float | None = None) -> None:
        """Stop admission; after ``grace_s`` the engine forwards every unfinished request with its KV
        (``LLMEngine.start_drain``). Raises its error (no transport: ConfigError; a bad grace_s)."""
        self._check_alive()
        self.attach()
        done = asyncio.get_running_loop().create_future()
        self._drains.append(done)
        self._send(["drain", grace_s])
        err = await done
        if err is not None:
            raise error_from_wire(err)
        self.draining = True

    def abort(self, request_id: str) -> None:
        if self.error is None:
            self._send(["abort", request_id])

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._send(["stop"])
        self._detach()
        if self._proc is not None:
            _stop_process(self._proc, 60)
        else:
            self._core_thread.join(timeout=60)
            self._engine.shutdown()
        self._channel.close()

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error}") from self.error
        if self._closed:
            raise EngineDeadError("the engine is shut down")

    def _send(self, command: list) -> None:
        try:
            with self._send_lock:
                self._channel.send(command)
        except OSError:  # the engine is gone: the reader reports it
            pass

    # ---- frames from the engine core --------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Read the engine's frames on ``loop`` (default: the running one). ``add`` attaches to its
        loop by itself; a server attaches at startup, so an engine that dies while no request runs
        is noticed at once."""
        loop = loop or asyncio.get_running_loop()
        if loop is self._loop:
            return
        self._detach()
        self._loop = loop
        loop.add_reader(self._channel.sock.fileno(), self._on_readable)

    def _detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._channel.sock.fileno())
            except (ValueError, OSError):  # the socket is closed already
                pass
        self._loop = None

    def _on_readable(self) -> None:
        """Event loop: the frames that arrived; EOF marks the engine dead."""
        try:
            frames = self._channel.poll()
        except (EOFError, OSError):
            self._detach()
            if not self._closed:
                self._died(EngineDeadError(f"the engine {self._exit_text()}"))
            return
        for f in frames:
            if f["t"] == "dead":
                self._died(error_from_wire(f["error"]))
        self._on_frames(frames)

    def _exit_text(self) -> str:
        if self._proc is None:
            return "thread stopped"
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        return f"process exited unexpectedly ({_exit_text(self._proc)})"

    def _died(self, exc: BaseException) -> None:
        if self.error is None:
            logger.error("engine failed: %s; failing all requests", exc)
            self.error = exc
        self._fail_all(exc)

    def _finish(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.num_unfinished -= stream.weight
        return stream

    def _fail_all(self, exc: BaseException) -> None:
        for done in self._drains:
            if not done.done():
                done.set_result(error_to_wire(EngineDeadError(f"the engine failed: {exc}")))
        self._drains.clear()
        for rid in list(self._streams):
            stream = self._finish(rid)
            if not stream.accepted.done():
                stream.accepted.set_exception(EngineDeadError(f"the engine failed: {exc}"))
                continue
            deltas = [CompletionDelta(i, "", [], None, "error") for i in range(stream.weight)]
            stream.put(RequestUpdate(rid, deltas, True, 0, error=exc))

    def _on_frames(self, frames: list) -> None:
        now = time.perf_counter()
        metrics = self.metrics
        for f in frames:
            if f["t"] != "step":
                continue
            for rid in f["acc"]:
                stream = self._streams.get(rid)
                if stream is not None and not stream.accepted.done():
                    stream.accepted.set_result(None)
            for rid, err in f["rej"]:
                stream = self._finish(rid)
                if stream is not None and not stream.accepted.done():
                    stream.accepted.set_exception(error_from_wire(err))
            for u in f["u"]:
                self._route(u, now)
            for err in f.get("drain", ()):
                if self._drains:
                    self._drains.pop(0).set_result(err)
            if metrics is not None and "load" in f:
                metrics.engine_load(f["load"])

    def _route(self, u: list, now: float) -> None:
        rid, finished, num_prompt, num_cached, deltas, output, error, stats = u
        stream = self._finish(rid) if finished else self._streams.get(rid)
        if stream is None:
            return
        if not stream.accepted.done():
            stream.accepted.set_result(None)
        metrics = self.metrics
        ds = []
        for i, text, ids, lps, reason, stop, transfer in deltas:
            ds.append(CompletionDelta(i, text, ids, logprobs_from_wire(lps), reason, stop, transfer))
            if ids and metrics is not None:
                first, last = stream.token_times.get(i, (None, None))
                metrics.tokens_emitted(len(ids), now, stream.arrival, first, last)
                stream.token_times[i] = (first or now, now)
        if stats is not None and metrics is not None:
            for reason, prompt_tokens, tiers, drafts, accepted in stats:
                metrics.request_finished(reason, prompt_tokens, tiers, drafts, accepted, now - stream.arrival)
        stream.put(RequestUpdate(rid, ds, finished, num_prompt, num_cached,
                                              None if output is None else output_from_wire(output),
                                              error_from_wire(error)))


def _exit_text(proc: subprocess.Popen) -> str:
    rc = proc.poll()
    if rc is None:
        return "still running"
    return f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"


def _stop_process(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
