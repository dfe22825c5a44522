"""The engine core of a server: one loop that owns the engine and talks JSON frames over a socket.

It runs in its own process (``python -m deepinfer_core.serving.engine_core FD``, started by
:meth:`AsyncLLM.spawn`), so the per-step host work of the engine and the HTTP/SSE work of the API
process never share a GIL; or, for an engine object built in-process, in a thread
(:class:`AsyncLLM` over that engine). The loop is the same either way:

1. read the commands sent since the last step (block only when there is nothing to run);
2. apply them: ``["add", rid, prompt, params]``, ``["abort", rid]``, ``["drain", grace_s]``, ``["stop"]``;
3. ``engine.step()``, then one ``"step"`` frame with every request's output delta, the requests
   accepted or rejected, and the engine's load (running, waiting, KV usage).

A delta carries the tokens, text and logprobs a completion added since the previous frame. Text
comes from an incremental detokenizer; while a request with stop strings runs, the last
``max_stop_len - 1`` characters are held back so streamed text never has to be taken back, and the
final delta's text is cut from the full decode, so the concatenated stream equals
``LLM.generate``'s text. A finished request also carries its whole output and, per completion, what
/metrics needs (finish reason, prompt tokens, cached tokens by tier, draft acceptance).

An abort reaches the engine before its next step, and that step drops the request and frees its KV
blocks (with dp/ep > 1, the owning rank does in the same lock step). If a step raises, the core sends
``["dead", error]`` and stops: every request fails with that error. If the API process goes away,
the socket reads EOF and the core shuts the engine down.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from deepinfer_core.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from deepinfer_core.engine.sample_group import SampleGroup, as_params, completion_output
from deepinfer_core.serving.wire import Channel, error_to_wire, logprobs_to_wire, output_to_wire

logger = logging.getLogger("deepinfer.serving")


@dataclass
class _Child:
    detok: IncrementalDetokenizer
    tokens: int = 0  # output tokens reported
    chars: int = 0  # text characters reported
    logprobs: int = 0  # logprob entries reported
    done: bool = False


@dataclass
class _Tracked:
    group: SampleGroup
    children: list[_Child] = field(default_factory=list)


def seq_stats(seq) -> list:
    """What /metrics counts for one finished completion: reason, prompt tokens, cache hits by tier,
    drafts verified and accepted (speculative decoding, any proposer)."""
    m = seq.metrics
    return [seq.finish_reason, len(seq.prompt_token_ids), m.num_cached_tokens_by_tier, m.num_draft_tokens,
            m.num_accepted_draft_tokens]


def engine_info(engine) -> dict:
    """What the API process needs to know about the engine (the ``"ready"`` frame)."""
    mc = engine.model_config
    layout = getattr(engine, "kv_layout_info", None)
    return {"model_dir": str(engine.model_dir), "max_model_len": engine.max_model_len,
            "bos_token_id": mc.bos_token_id, "eos_token_id": mc.eos_token_id, "vocab_size": mc.vocab_size,
            "kv_layout": layout() if layout is not None else None,
            "can_drain": hasattr(engine, "start_drain") and bool(engine.cfg.kv_transfer)}


class EngineCore:
    """The loop over one engine; ``run`` returns on ``stop``, EOF, or an engine failure."""

    def __init__(self, engine, channel: Channel, sampling_defaults: dict | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.channel = channel
        self.sampling_defaults = dict(sampling_defaults or {})
        self._texts = TokenTexts(self.tokenizer)
        self._tracked: dict[str, _Tracked] = {}

    def run(self) -> None:
        engine, channel = self.engine, self.channel
        while True:
            idle = not engine.has_unfinished()
            try:
                commands = channel.recv() if idle else channel.poll()
            except (EOFError, OSError):  # the API process is gone
                self._abort_all()
                return
            frame = {"t": "step", "u": [], "acc": [], "rej": []}
            aborted = self._apply(commands, frame)
            if aborted is None:
                self._abort_all()
                return
            try:
                if engine.has_unfinished() or aborted:  # a step also drops aborted requests
                    engine.step()
                    for t in self._tracked.values():
                        if t.group.pending:
                            t.group.release(engine)
                    self._collect(frame["u"])
                    frame["load"] = engine.load_stats()
            except Exception as exc:  # the engine itself failed: every request fails with it
                logger.exception("engine step failed; failing all requests")
                self._send({"t": "dead", "error": error_to_wire(exc)})
                return
            if frame["u"] or frame["acc"] or frame["rej"] or "load" in frame or "drain" in frame:
                if not self._send(frame):
                    self._abort_all()
                    return

    def _send(self, message) -> bool:
        try:
            self.channel.send(message)
            return True
        except OSError:
            return False

    def _apply(self, commands: list, frame: dict) -> bool | None:
        """Adds and aborts sent since the last step; whether one aborted, None on stop."""
        aborted = False
        for cmd in commands:
            kind = cmd[0]
            if kind == "stop":
                return None
            if kind == "drain":  # stop admission, forward the unfinished requests (LLMEngine.start_drain)
                try:
                    self.engine.start_drain(cmd[1])
                    frame.setdefault("drain", []).append(None)
                except Exception as exc:  # no transport, a bad grace_s, an engine without drain
                    frame.setdefault("drain", []).append(error_to_wire(exc))
                continue
            if kind == "abort":
                t = self._tracked.pop(cmd[1], None)
                if t is not None:
                    self._abort_group(t)
                    aborted = True
                    first = t.group.seqs[0]
                    frame["u"].append([cmd[1], True, len(first.prompt_token_ids), 0, [], None, None,
                                       [["abort", *seq_stats(s)[1:]] for s in t.group.seqs]])
                continue
            _, rid, prompt, params = cmd
            try:
                group = SampleGroup(self.engine, prompt, as_params(params, self.sampling_defaults), rid)
            except (ValueError, TypeError) as exc:
                frame["rej"].append([rid, error_to_wire(exc)])
                continue
            self._tracked[rid] = _Tracked(group)
            frame["acc"].append(rid)
        return aborted

    def _abort_group(self, t: _Tracked) -> None:
        for seq in t.group.seqs:
            if not seq.is_finished:
                self.engine.abort(seq.request_id)
        t.group._child_params = t.group._child_params[: len(t.group.seqs)]  # siblings never queued

    def _abort_all(self) -> None:
        for t in self._tracked.values():
            self._abort_group(t)
        self._tracked.clear()

    def _collect(self, updates: list) -> None:
        for rid, t in list(self._tracked.items()):
            deltas = []
            for i, seq in enumerate(t.group.seqs):
                if i == len(t.children):
                    t.children.append(_Child(IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)))
                d = self._child_delta(t.children[i], i, seq)
                if d is not None:
                    deltas.append(d)
            finished = t.group.finished
            if not deltas and not finished:
                continue
            first = t.group.seqs[0]
            output = error = stats = None
            if finished:
                del self._tracked[rid]
                output = output_to_wire(t.group.output(self.tokenizer, self._texts))
                errors = [s.error for s in t.group.seqs if s.error is not None]
                error = error_to_wire(errors[0]) if errors else None
                stats = [seq_stats(s) for s in t.group.seqs]
            updates.append([rid, finished, len(first.prompt_token_ids), first.metrics.num_cached_tokens, deltas,
                            output, error, stats])

    def _child_delta(self, c: _Child, i: int, seq) -> list | None:
        """``[index, text, token_ids, logprobs, finish_reason, stop_reason, kv_transfer_params]`` added since
        the last frame (``kv_transfer_params``: a completion forwarded by a drain)."""
        if c.done:
            return None
        n = seq.num_output_tokens
        if n == c.tokens and not seq.is_finished:
            return None
        new_ids = seq.token_ids[seq.num_prompt_tokens + c.tokens : seq.num_known_tokens]
        c.detok.feed(new_ids)
        c.tokens = n
        if seq.is_finished and seq.finish_reason == "forwarded":  # continued elsewhere: keep the held-back text
            visible = len(c.detok.text) - max(0, seq.params.max_stop_len - 1)  # (a stop string may still match)
            delta_text = c.detok.text[c.chars:visible] if visible > c.chars else ""
            c.chars, c.done = max(c.chars, visible), True
        elif seq.is_finished:
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
        transfer = seq.kv_transfer_out if c.done and seq.finish_reason == "forwarded" else None
        return [i, delta_text, new_ids, logprobs_to_wire(logprobs), seq.finish_reason if c.done else None,
                seq.stop_reason if c.done else None, transfer]


def main(argv: list[str] | None = None) -> int:
    """The engine process: build the engine from the config sent first, say ``ready``, run the loop."""
    import os
    import signal
    import socket
    import sys
    import threading

    from deepinfer_core.config import compose
    from deepinfer_core.llm import make_engine
    from deepinfer_core.models.generation_config import sampling_defaults

    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when the engine stops
    channel = Channel(socket.socket(fileno=int(args[0])))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        (hello,) = channel.recv()[:1]
        if hello.get("log_level"):
            logging.getLogger("deepinfer").setLevel(hello["log_level"])
        engine = make_engine(compose(hello["config"], **hello["overrides"]))
    except Exception as exc:  # a bad config or checkpoint: one line for the API process to show
        logger.debug("engine startup failed", exc_info=True)
        channel.send({"t": "failed", "error": error_to_wire(exc)})
        return 2
    try:
        channel.send({"t": "ready", "info": engine_info(engine), "pid": os.getpid()})
        # The loop runs in a worker thread, as the offline bench steps its engine: on a busy CPU machine
        # torch ops issued from this process's main thread ran 3 tok/s where the same loop in a thread
        # ran 75 (tiny model, 64 tokens, load 7 on 2 cores).
        loop = threading.Thread(target=EngineCore(engine, channel, sampling_defaults(engine.model_dir)).run,
                                name="deepinfer-engine-core")
        loop.start()
        loop.join()
    finally:
        engine.shutdown()
        channel.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
