"""The router's decode side: each prompt's decode leg, whole or streamed, and the completions a
draining decode engine forwarded, continued on another one.

A decode leg carries one prompt's hand-off (the prefill engine's ``kv_transfer_params``, child 0's
state) and all its samples (``n`` / ``best_of``): the decode engine forks them from the handed-off
prompt blocks (``engine/sample_group.py``). A decode engine that drains finishes each unfinished
completion with ``finish_reason == "forwarded"`` and that completion's own ``kv_transfer_params``;
the router continues each alone (``n = 1`` and seed ``seed + i`` for sample ``i``: the seed it had)
on another decode engine, which appends the handed-off tokens and decodes on, so the completion is
the undisturbed run's. Every leg asks for ``pd_accounting``: each finished choice then says its
token count and cumulative logprob, from which the router counts usage and, when a best_of
candidate was forwarded (the engine then returns every candidate, unranked), ranks them as the
engine would. Streamed, the legs of all prompts and their continuations are merged into one SSE
stream; :class:`Relay` drops what a continuation repeats (its handed-off tokens' text and logprobs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deepinfer_core.router.client import EngineHTTPError, request_json, stream_events
from deepinfer_core.router.relay import Relay

logger = logging.getLogger("deepinfer.router")
MAX_FORWARDS = 8  # a completion forwarded more often than this fails (every decode engine draining in turn)


@dataclass
class PromptLeg:
    """One prompt of a request, after its prefill leg."""

    index: int  # its position in the request's prompt list: its choices are index * n + sample
    n: int
    best_of: int | None
    body: dict  # the client's request with this prompt's ids (chat: the messages)
    first: dict  # the prefill engine's whole reply
    tokens: dict[int, int] = field(default_factory=dict)  # completion tokens per finished sample

    @property
    def samples(self) -> int:
        return self.best_of or self.n

    @property
    def limit(self) -> int:
        return int(self.body.get("max_completion_tokens") or self.body.get("max_tokens") or 16)

    def finished_at_first(self) -> bool:
        """The prefill engine's one sample is the whole answer (a stop or max_tokens at the first token)."""
        return (self.samples == 1 and self.first.get("kv_transfer_params") is None
                and (self.first["choices"][0]["finish_reason"] != "length" or self.limit == 1))

    def kv_tokens(self) -> int:
        return self.first["usage"]["prompt_tokens"] + self.samples * self.limit

    def child(self, body: dict, i: int) -> dict:
        """``body`` for sample ``i`` alone: the seed it was given (``SampleGroup``: seed + i)."""
        out = {k: v for k, v in body.items() if k not in ("n", "best_of")}
        if body.get("seed") is not None:
            out["seed"] = body["seed"] + i
        return out

    def decode_body(self, body: dict, transfer: dict | None, stream: bool) -> dict:
        out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        out.update(kv_transfer_params=transfer, pd_accounting=True)
        return {**out, "stream": True} if stream else out


def usage(legs: list[PromptLeg]) -> dict:
    """The request's usage: prompts and prefix-cache hits as the prefill engines counted them, the
    completion tokens of the choices returned."""
    prompt = sum(leg.first["usage"]["prompt_tokens"] for leg in legs)
    cached = sum((leg.first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for leg in legs)
    completion = sum(sum(leg.tokens.values()) for leg in legs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def public(choice: dict, index: int) -> dict:
    """A choice as the client sees it: the router's fields gone, its index in the whole request."""
    return {**{k: v for k, v in choice.items() if k not in ("pd", "kv_transfer_params")}, "index": index}


class DecodeLegs:
    def __init__(self, router) -> None:
        self.r = router

    # ---- whole ------------------------------------------------------------------------------
    async def whole(self, path: str, legs: list[PromptLeg], chat: bool) -> dict:
        tasks = [asyncio.ensure_future(self._whole_prompt(path, leg)) for leg in legs]
        try:
            replies = await asyncio.gather(*tasks)
        except BaseException:  # one prompt failed: the others' decode engines drop theirs (connection closed)
            for t in tasks:
                t.cancel()
            raise
        choices = [public(c, leg.index * leg.n + c["index"]) for leg, (_, cs) in zip(legs, replies) for c in cs]
        head = replies[0][0]
        return {"object": "chat.completion" if chat else "text_completion", "model": head.get("model"),
                "choices": choices, "usage": usage(legs)}

    async def _whole_prompt(self, path: str, leg: PromptLeg) -> tuple[dict, list[dict]]:
        if leg.finished_at_first():
            leg.tokens[0] = leg.first["usage"]["completion_tokens"]
            return leg.first, leg.first["choices"]
        reply, choices = await self._settle(path, leg, leg.body, leg.first.get("kv_transfer_params"), None, 0)
        if len(choices) > leg.n:  # a best_of candidate was forwarded: rank them here, as SampleGroup.output
            choices = sorted(choices, key=lambda c: c["pd"]["cumulative_logprob"] or 0.0, reverse=True)[: leg.n]
            choices = [{**c, "index": i} for i, c in enumerate(choices)]
        leg.tokens.update((c["index"], c["pd"]["completion_tokens"]) for c in choices)
        return reply, choices

    async def _settle(self, path: str, leg: PromptLeg, body: dict, transfer: dict | None, exclude: str | None,
                      depth: int) -> tuple[dict, list[dict]]:
        """The decode engine's reply to ``body`` and its choices, forwarded ones continued elsewhere."""
        if depth > MAX_FORWARDS:
            raise RuntimeError(f"a completion was forwarded {MAX_FORWARDS} times without finishing")
        reply, url = await self._decode_whole(path, leg, leg.decode_body(body, transfer, False), exclude)
        done = [c for c in reply["choices"] if c.get("finish_reason") != "forwarded"]
        later = [c for c in reply["choices"] if c.get("finish_reason") == "forwarded"]
        if later:
            self.r.counts["forwarded"] += len(later)
            self.r.decode.engine(url).draining = True
        continued = await asyncio.gather(*(self._settle(path, leg, leg.child(body, c["index"]),
                                                        c.get("kv_transfer_params"), url, depth + 1) for c in later))
        done += [{**cs[0], "index": c["index"]} for c, (_, cs) in zip(later, continued)]
        return reply, sorted(done, key=lambda c: c["index"])

    async def _decode_whole(self, path: str, leg: PromptLeg, body: dict, exclude: str | None) -> tuple[dict, str]:
        """(reply, engine URL); an engine answering 503 (draining or dead) is skipped for another."""
        kv = leg.kv_tokens()
        for _ in range(len(self.r.decode.urls)):
            url = self.r.decode.pick(1, kv, exclude=exclude)
            try:
                return await request_json(url + path, body=body), url
            except EngineHTTPError as exc:
                if exc.status != 503:
                    raise
                self.r.decode.engine(url).draining = True
                exclude = url
            finally:
                self.r.decode.done(url, 1, kv)
        raise RuntimeError("no decode engine accepted the request (all draining)")

    # ---- streamed ---------------------------------------------------------------------------
    async def stream(self, path: str, legs: list[PromptLeg], rid: str, chat: bool,
                     include_usage: bool) -> AsyncIterator[str]:
        """SSE frames of every prompt's decode leg(s), merged, after the prefill legs."""
        q: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []
        running = [0]  # legs not yet done
        relay = Relay()
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": legs[0].first.get("model")}

        def spawn(leg: PromptLeg, body: dict, transfer: dict | None, children: list[int], exclude: str | None,
                  depth: int) -> None:
            async def run() -> None:
                try:
                    await self._stream_leg(path, leg, body, transfer, children, exclude, depth, q, spawn)
                except Exception as exc:
                    await q.put(("error", exc))
                finally:
                    await q.put(("done", None))

            running[0] += 1
            tasks.append(asyncio.create_task(run()))

        for leg in legs:
            if leg.finished_at_first():
                leg.tokens[0] = leg.first["usage"]["completion_tokens"]
                for frame in whole_as_frames(leg.first, head, leg.index * leg.n):
                    q.put_nowait(("frame", frame))
            else:
                spawn(leg, leg.body, leg.first.get("kv_transfer_params"), list(range(leg.samples)), None, 0)
        try:
            while running[0] or not q.empty():
                kind, x = await q.get()
                if kind == "done":
                    running[0] -= 1
                    continue
                if kind == "reset":  # a new engine takes these choices over: it starts from their first token
                    relay.next_engine(x)
                    continue
                if kind == "error":
                    yield sse(error_body(x))
                    break
                if "error" in x:
                    yield sse(x)
                    break
                frame = relay.frame({**x, **head})
                if frame is not None:
                    yield sse(frame)
            else:
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage(legs)})
            yield sse("[DONE]")
        finally:  # a client that left, or an error: the decode engines' connections close, which aborts there
            for t in tasks:
                t.cancel()

    async def _stream_leg(self, path: str, leg: PromptLeg, body: dict, transfer: dict | None, children: list[int],
                          exclude: str | None, depth: int, q: asyncio.Queue, spawn) -> None:
        """Relay one decode engine's stream of ``children`` (sample numbers, by the leg's choice index);
        a forwarded one is spawned as its own leg on another engine."""
        if depth > MAX_FORWARDS:
            raise RuntimeError(f"a completion was forwarded {MAX_FORWARDS} times without finishing")
        kv, base = leg.kv_tokens(), leg.index * leg.n
        for _ in range(len(self.r.decode.urls)):
            url = self.r.decode.pick(1, kv, exclude=exclude)
            await q.put(("reset", [base + c for c in children]))
            events = stream_events(url + path, leg.decode_body(body, transfer, True))
            forwarded = False
            try:
                async for data in events:
                    if data == "[DONE]":
                        break
                    frame = json.loads(data)
                    if "error" in frame:
                        await q.put(("frame", frame))
                        return
                    keep = []
                    for c in frame.get("choices") or []:
                        local = c.get("index", 0)
                        child = children[local]
                        if c.get("finish_reason") == "forwarded":  # its text and logprobs come again from the next
                            forwarded = True
                            self.r.counts["forwarded"] += 1
                            self.r.counts["forwarded_streams"] += 1
                            spawn(leg, leg.child(body, local), c.get("kv_transfer_params"), [child], url, depth + 1)
                            continue
                        if c.get("pd") is not None:
                            leg.tokens[child] = c["pd"]["completion_tokens"]
                        keep.append(public(c, base + child))
                    if keep:
                        rest = {k: v for k, v in frame.items() if k not in ("kv_transfer_params", "usage")}
                        await q.put(("frame", {**rest, "choices": keep}))
            except EngineHTTPError as exc:
                if exc.status != 503:
                    raise
                self.r.decode.engine(url).draining = True
                exclude = url
                continue
            finally:
                await events.aclose()
                self.r.decode.done(url, 1, kv)
            if forwarded:
                self.r.decode.engine(url).draining = True
            return
        raise RuntimeError("no decode engine accepted the request (all draining)")


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def error_body(exc: BaseException) -> dict:
    logger.error("streaming failed: %s: %s", type(exc).__name__, exc)
    if isinstance(exc, EngineHTTPError) and isinstance(exc.body, dict):
        return exc.body
    return {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "router_error", "code": "engine_error"}}


def whole_as_frames(out: dict, head: dict, base: int) -> list[dict]:
    """A whole reply (a prompt that finished at its prefill token) as stream frames, indexed from ``base``."""
    frames = []
    for c in out["choices"]:
        if "message" in c:
            delta = {k: v for k, v in c["message"].items() if v is not None}
            frames.append({**head, "choices": [{"index": base + c["index"], "delta": delta,
                                                "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]}]})
        else:
            frames.append({**head, "choices": [{"index": base + c["index"], "text": c["text"],
                                                "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]}]})
    return frames

