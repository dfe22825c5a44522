"""Relaying decode engines' SSE streams to the router's client, across drain-forwards.

A decode engine that drains mid-stream ends a completion with ``finish_reason == "forwarded"`` and
that completion's ``kv_transfer_params``; the router continues it on another decode engine, whose
stream starts again from the handed-off tokens (their text and logprobs are re-emitted as the new
engine appends them as outputs). :class:`Relay` passes each frame on without what the client
already has, per choice and field by field (``text``; a chat delta's ``role``, ``content``,
``reasoning_content`` and each tool call's ``id``/``name``/``arguments``; the logprob entries, one
per token), so the client sees one stream with no token, character or logprob entry twice.
"""

from __future__ import annotations

from collections import Counter


class Relay:
    def __init__(self) -> None:
        self.sent: Counter = Counter()  # characters (logprobs: entries) of each field the client has
        self.seen: Counter = Counter()  # ... that the engine now streaming that choice sent

    def next_engine(self, indices: list[int] | None = None) -> None:
        """A new decode engine streams the choices ``indices`` (all: None) from their first token."""
        self.seen = Counter({k: v for k, v in self.seen.items() if indices is not None and k[0] not in indices})

    def _logprobs(self, i: int, lp: dict | None) -> dict | None:
        """The entries of ``lp`` (completions: parallel lists; chat: ``content``) the client lacks."""
        if not lp:
            return lp
        lists = {k: v for k, v in lp.items() if isinstance(v, list)}
        count = max((len(v) for v in lists.values()), default=0)
        skip = max(0, self.sent[(i, "logprobs")] - self.seen[(i, "logprobs")])
        self.seen[(i, "logprobs")] += count
        self.sent[(i, "logprobs")] += max(0, count - skip)
        if skip >= count:
            return None
        return {**lp, **{k: v[skip:] for k, v in lists.items()}}

    def _take(self, key, s: str) -> str:
        skip = max(0, self.sent[key] - self.seen[key])
        self.seen[key] += len(s)
        out = s[skip:]
        self.sent[key] += len(out)
        return out

    def frame(self, frame: dict) -> dict | None:
        """``frame`` without what was already relayed; None when nothing is left to send."""
        choices = []
        for c in frame.get("choices") or []:
            c = dict(c)
            i = c.get("index", 0)
            if "delta" in c:
                c["delta"] = self._delta(i, c["delta"])
                keep = bool(c["delta"])
            else:
                c["text"] = self._take((i, "text"), c.get("text") or "")
                keep = bool(c["text"])
            c["logprobs"] = self._logprobs(i, c.get("logprobs"))
            if keep or c.get("finish_reason") is not None or c.get("logprobs"):
                choices.append(c)
        if not choices and frame.get("choices") and frame.get("usage") is None:
            return None
        return {**frame, "choices": choices}

    def _delta(self, i: int, delta: dict) -> dict:
        out = {}
        for key in ("role", "content", "reasoning_content"):
            if isinstance(delta.get(key), str) and (s := self._take((i, key), delta[key])):
                out[key] = s
        calls = []
        for t in delta.get("tool_calls") or []:
            j, fn = t.get("index", 0), dict(t.get("function") or {})
            call: dict = {"index": j}
            if t.get("id") and (s := self._take((i, j, "id"), t["id"])):
                call["id"], call["type"] = s, t.get("type", "function")
            for key in ("name", "arguments"):
                if isinstance(fn.get(key), str):
                    fn[key] = self._take((i, j, key), fn[key])
                    if not fn[key] and not (key == "arguments" and "id" in call):
                        del fn[key]
            if fn:
                call["function"] = fn
            if len(call) > 1:
                calls.append(call)
        if calls:
            out["tool_calls"] = calls
        return out
