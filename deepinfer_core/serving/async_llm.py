"""AsyncLLM: an asyncio front end over one engine, for servers.

One background **thread** owns the engine: it alone calls ``add_request``, ``abort`` and ``step``,
so the engine stays single-threaded exactly as under ``LLM.generate``. Callers on the event loop
send it commands (a thread-safe queue plus a wake-up event) and receive per-request updates, which
the thread hands back once per step with ``loop.call_soon_threadsafe``.

Why a thread and not an asyncio task driving ``step()``: a step blocks for its whole forward pass
(milliseconds on a GPU, up to seconds for a long prefill on a CPU); inside the event loop it would
stall every connection, accept and SSE flush for that long. In a thread, torch releases the GIL
during kernels, so the loop keeps serving while the device works. A separate engine process (vLLM
v1's EngineCore) would also isolate the Python host work, at the price of serialising every
request and output; with dp/ep > 1 the model already runs in worker processes and the thread only
drives the :class:`~deepinfer_core.parallel.launcher.ParallelEngine`, which offers the same
interface, so AsyncLLM works unchanged there.

Each update carries, per completion, the tokens, text and logprobs added since the previous one.
Text comes from an incremental detokenizer; while a request with stop strings runs, the last
``max_stop_len - 1`` characters are held back, so streamed text never has to be taken back. The
final update's text is cut from the full decode, so the concatenated stream equals
``LLM.generate``'s text exactly.

Abort (``RequestStream.abort()``, or the consumer leaving the ``async for``) reaches the engine
thread before its next step; the engine frees the request's KV blocks at once (with dp/ep, the
owning rank does in the next lock step).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deepinfer_core.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from deepinfer_core.engine.sample_group import SampleGroup, as_params, completion_output
from deepinfer_core.outputs import Logprob, RequestOutput
from deepinfer_core.sampling_params import SamplingParams

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


@dataclass
class RequestUpdate:
    request_id: str
    deltas: list[CompletionDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    output: RequestOutput | None = None  # the final output (finished updates only)
    error: BaseException | None = None  # the request failed (finish_reason "error"), or the engine died


@dataclass
class _Child:
    detok: IncrementalDetokenizer
    tokens: int = 0  # output tokens reported
    chars: int = 0  # text characters reported
    logprobs: int = 0  # logprob entries reported
    done: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _Tracked:
    request_id: str
    group: SampleGroup
    stream: RequestStream
    arrival: float
    children: list[_Child] = field(default_factory=list)


class RequestStream:
    """The updates of one request, consumed with ``async for`` on the event loop."""

    def __init__(self, owner: AsyncLLM, request_id: str) -> None:
        self.owner, self.request_id = owner, request_id
        self.queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.finished = False
        self.weight = 1  # completions it draws (n / best_of): what it counts against the admission limit

    async def __aiter__(self) -> AsyncIterator[RequestUpdate]:
        try:
            while not self.finished:
                update = await self.queue.get()
                self.finished = update.finished
                yield update
        finally:
            if not self.finished:  # the consumer left early (client gone, cancelled)
                self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncLLM:
    """An engine driven by a background thread; ``add`` a request, then iterate its stream.

    ``engine``: an ``LLMEngine`` or ``ParallelEngine`` (``deepinfer_core.llm.make_engine``).
    ``metrics``: an optional :class:`~deepinfer_core.serving.metrics.ServingMetrics`.
    """

    def __init__(self, engine, metrics=None, sampling_defaults: dict | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.metrics = metrics
        self.sampling_defaults = dict(sampling_defaults or {})
        self.error: BaseException | None = None
        self.num_unfinished = 0  # completions (n per request) added and not yet finished (event-loop side)
        self._texts = TokenTexts(self.tokenizer)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._aborted = False
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    # ---- event-loop side ------------------------------------------------------------------
    async def add(self, prompt, params: SamplingParams | dict | None = None,
                  request_id: str | None = None, arrival: float | None = None) -> RequestStream:
        """Queue a request. Raises the engine's ValueError/TypeError for bad input (before any
        output), :class:`EngineDeadError` if the engine failed."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error}") from self.error
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        self._loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(self, request_id)
        stream.weight = params.num_samples if isinstance(params, SamplingParams) else 1
        self.num_unfinished += stream.weight
        self._send(("add", request_id, prompt, params, stream, arrival or time.perf_counter()))
        try:
            await stream.accepted
        except asyncio.CancelledError:  # the caller left while the request was being queued
            stream.abort()  # its abort (or rejection) update settles num_unfinished
            raise
        except BaseException:
            self.num_unfinished -= stream.weight
            stream.finished = True
            raise
        return stream

    async def generate(self, prompt, params: SamplingParams | dict | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """The final output of one request."""
        stream = await self.add(prompt, params, request_id)
        async for update in stream:
            if update.finished:
                return update.output
        raise EngineDeadError("request stream ended without an output")

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._send(("stop",))
        self._thread.join(timeout=60)
        self.engine.shutdown()

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, updates: list[tuple[RequestStream, RequestUpdate | BaseException | None]]) -> None:
        for stream, item in updates:
            if isinstance(item, BaseException):  # add_request rejected it
                if stream.accepted.done():  # its caller was cancelled meanwhile: nobody else counts it
                    self.num_unfinished -= stream.weight
                else:
                    stream.accepted.set_exception(item)
                continue
            if not stream.accepted.done():
                stream.accepted.set_result(None)
            if item is not None:
                if item.finished:
                    self.num_unfinished -= stream.weight
                stream.queue.put_nowait(item)

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            out: list = []
            self._aborted = False
            if not self._apply_commands(out):
                break
            try:
                if engine.has_unfinished() or self._aborted:  # a step also drops aborted requests
                    engine.step()
                    for t in list(self._tracked.values()):
                        if t.group.pending:
                            t.group.release(engine)
                    self._collect(out)
                    if self.metrics is not None:
                        self.metrics.engine_load(engine.load_stats())
                else:
                    self._post(out)
                    self._wake.wait()
                    self._wake.clear()
                    continue
            except Exception as exc:  # the engine itself failed: every request fails with it
                logger.exception("engine step failed; failing all requests")
                self.error = exc
                for t in self._tracked.values():
                    out.append((t.stream, self._failed_update(t, exc)))
                self._tracked.clear()
                self._post(out)
                self._drain_after_failure(exc)
                return
            self._post(out)

    def _post(self, out: list) -> None:
        if out and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, out)

    def _apply_commands(self, out: list) -> bool:
        """Adds and aborts sent since the last step; False on stop."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            if cmd[0] == "stop":
                for t in self._tracked.values():
                    self._abort_group(t)
                return False
            if cmd[0] == "abort":
                t = self._tracked.pop(cmd[1], None)
                if t is not None:
                    self._abort_group(t)
                    self._aborted = True
                    out.append((t.stream, RequestUpdate(t.request_id, [], True, len(t.group.seqs[0].prompt_token_ids),
                                                        output=None)))
                    if self.metrics is not None:
                        self.metrics.request_finished("abort", t.group.seqs[0])
                continue
            _, rid, prompt, params, stream, arrival = cmd
            try:
                params = as_params(params, self.sampling_defaults)
                group = SampleGroup(self.engine, prompt, params, rid)
            except (ValueError, TypeError) as exc:
                out.append((stream, exc))
                continue
            t = _Tracked(rid, group, stream, arrival)
            self._tracked[rid] = t
            out.append((stream, None))

    def _abort_group(self, t: _Tracked) -> None:
        for seq in t.group.seqs:
            if not seq.is_finished:
                self.engine.abort(seq.request_id)
        t.group._child_params = t.group._child_params[: len(t.group.seqs)]  # siblings never queued

    def _collect(self, out: list) -> None:
        now = time.perf_counter()
        for rid, t in list(self._tracked.items()):
            deltas = []
            for i, seq in enumerate(t.group.seqs):
                if i == len(t.children):
                    t.children.append(_Child(IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)))
                d = self._child_delta(t, i, seq, now)
                if d is not None:
                    deltas.append(d)
            finished = t.group.finished
            if not deltas and not finished:
                continue
            first = t.group.seqs[0]
            update = RequestUpdate(rid, deltas, finished, len(first.prompt_token_ids), first.metrics.num_cached_tokens)
            if finished:
                del self._tracked[rid]
                update.output = t.group.output(self.tokenizer, self._texts)
                errors = [s.error for s in t.group.seqs if s.error is not None]
                update.error = errors[0] if errors else None
                if self.metrics is not None:
                    for seq in t.group.seqs:
                        self.metrics.request_finished(seq.finish_reason, seq, t.arrival)
            out.append((t.stream, update))

    def _child_delta(self, t: _Tracked, i: int, seq, now: float) -> CompletionDelta | None:
        c = t.children[i]
        if c.done:
            return None
        n = seq.num_output_tokens
        if n == c.tokens and not seq.is_finished:
            return None
        new_ids = seq.token_ids[seq.num_prompt_tokens + c.tokens : seq.num_known_tokens]
        c.detok.feed(new_ids)
        if new_ids and self.metrics is not None:
            self.metrics.tokens_emitted(len(new_ids), now, t.arrival, c.first_token_time, c.last_token_time)
        if new_ids:
            c.first_token_time = c.first_token_time or now
            c.last_token_time = now
        c.tokens = n
        if seq.is_finished:
            text = completion_output(seq, self.tokenizer).text
            if not text.startswith(c.detok.text[: c.chars]):
                logger.warning("request %s: incremental text diverged from the full decode", seq.request_id)
            delta_text, c.chars, c.done = text[c.chars:], len(text), True
        else:
            visible = len(c.detok.text) - max(0, seq.params.max_stop_len - 1)
            delta_text = c.detok.text[c.chars:visible] if visible > c.chars else ""
            c.chars = max(c.chars, visible)
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = seq.output_logprobs[c.logprobs:]
            c.logprobs = len(seq.output_logprobs)
            self._texts.fill(logprobs)
        return CompletionDelta(i, delta_text, new_ids, logprobs, seq.finish_reason if c.done else None,
                               seq.stop_reason if c.done else None)

    def _failed_update(self, t: _Tracked, exc: BaseException) -> RequestUpdate:
        deltas = [CompletionDelta(i, "", [], None, "error") for i in range(len(t.group.seqs))]
        return RequestUpdate(t.request_id, deltas, True, len(t.group.seqs[0].prompt_token_ids), error=exc)

    def _drain_after_failure(self, exc: BaseException) -> None:
        """After an engine failure: reject whatever is still sent, until stop."""
        while True:
            cmd = self._commands.get()
            if cmd[0] == "stop":
                return
            if cmd[0] == "add":
                self._post([(cmd[4], EngineDeadError(f"the engine failed: {exc}"))])
