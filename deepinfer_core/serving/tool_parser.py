"""Streaming parsers for reasoning content and tool calls in generated text.

Both consume the text deltas of one completion (already UTF-8 complete: the detokenizer holds back
partial characters) and return what each delta adds to the OpenAI message fields. A marker split
across deltas is held back until it is complete or ruled out, so a client never sees half a tag.
The non-streamed result is the same parser fed the whole text at once, so streamed fragments always
reassemble to exactly the non-streamed message.

Tool-call format (the embedded model's chat template, and Hermes/Qwen-style models)::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

``arguments`` stream as raw JSON text fragments as the model writes them; the wrapper's closing
``}`` is withheld until ``</tool_call>`` shows it is not part of the arguments.

DeepSeek format (V3/R1 chat templates; V3.1 drops the ``function`` type and the code fence)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Its markers are special tokens, so such a request is decoded with ``skip_special_tokens=False``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ReasoningParser:
    """Splits ``<think>...</think>`` reasoning from the answer. ``in_reasoning``: the prompt already
    opened the reasoning block (e.g. DeepSeek-R1's template ends with ``<think>``)."""

    def __init__(self, start: str = "<think>", end: str = "</think>", in_reasoning: bool = False) -> None:
        self.start, self.end = start, end
        self.state = "reasoning" if in_reasoning else "maybe_start"
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) added by ``text``."""
        self.buf += text
        reasoning = content = ""
        if self.state == "maybe_start":
            stripped = self.buf.lstrip()
            if stripped.startswith(self.start):
                self.buf, self.state = stripped[len(self.start):], "reasoning"
            elif self.start.startswith(stripped) and not final:
                return "", ""  # may still become the start tag
            else:
                self.state = "content"
        if self.state == "reasoning":
            i = self.buf.find(self.end)
            if i >= 0:
                reasoning, self.buf, self.state = self.buf[:i], self.buf[i + len(self.end):], "content"
            else:
                keep = 0 if final else _held_suffix(self.buf, self.end)
                reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
        if self.state == "content":
            content, self.buf = self.buf, ""
        return reasoning, content


_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class _CallStream:
    """What both tool-call formats share: the text buffer, the calls parsed so far, the content before
    a marker, and the arguments each feed adds to the open call."""

    def __init__(self) -> None:
        self.buf = ""
        self.calls: list[dict] = []  # {"id", "name", "arguments"} as parsed so far
        self._args_sent = 0

    def _content_until(self, out: ParsedDelta, markers: tuple[str, ...], final: bool) -> str | None:
        """Move the text before the first of ``markers`` into ``out.content``, drop the marker, and
        return it; None when no marker is in the buffer (then all is content but a tail that may
        still begin one)."""
        hits = [(i, m) for m in markers if (i := self.buf.find(m)) >= 0]
        if not hits:
            keep = 0 if final else max(_held_suffix(self.buf, m) for m in markers)
            out.content += self.buf[: len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            return None
        i, marker = min(hits)
        out.content += self.buf[:i]
        self.buf = self.buf[i + len(marker):]
        return marker

    def _open_call(self, name: str | None) -> dict:
        self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": ""})
        self._args_sent = 0
        return self.calls[-1]

    def _send_args(self, out: ParsedDelta, args: str) -> None:
        """The open call's arguments are ``args`` so far: add what is new to ``out``."""
        if len(args) <= self._args_sent:
            return
        new, self._args_sent = args[self._args_sent:], len(args)
        self.calls[-1]["arguments"] = args
        index = len(self.calls) - 1
        if out.tool_calls and out.tool_calls[-1].index == index:
            out.tool_calls[-1].arguments += new
        else:
            out.tool_calls.append(ToolCallDelta(index, arguments=new))


class ToolCallParser(_CallStream):
    """Streams ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks out of the text."""

    begin, end = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.in_call = False
        self._name_sent = False

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        self.buf += text
        out = ParsedDelta()
        while True:
            if not self.in_call:
                if self._content_until(out, (self.begin,), final) is None:
                    return out
                self.in_call, self._name_sent = True, False
                self._open_call(None)
            call = self.calls[-1]
            m = _NAME.match(self.buf)
            if m is None:
                if self.end in self.buf or final:  # not our format after all: give it back as text
                    out.content += self.begin + self.buf
                    self.calls.pop()
                    self.buf, self.in_call = "", False
                    if final:
                        return out
                    continue
                return out
            if not self._name_sent:
                call["name"] = json.loads(f'"{m.group(1)}"')
                out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, call["id"], call["name"]))
                self._name_sent = True
            body = self.buf[m.end():]
            j = body.find(self.end)
            if j >= 0:
                args = _strip_wrapper_close(body[:j])
            else:
                args = body[: len(body) - _held_suffix(body, self.end)]
                args = args if final else _withhold_close(args)
            self._send_args(out, args)
            if j < 0:
                return out
            self.buf, self.in_call = body[j + len(self.end):], False


def _strip_wrapper_close(args: str) -> str:
    """The arguments text of a complete block: without the wrapper object's closing brace."""
    s = args.rstrip()
    return s[:-1].rstrip() if s.endswith("}") else s


def _withhold_close(args: str) -> str:
    """While the block is open: hold back a trailing ``}`` (and whitespace), which may be the wrapper's."""
    s = args.rstrip()
    return s[:-1] if s.endswith("}") else s


class DeepSeekToolCallParser(_CallStream):
    """Streams DeepSeek's ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` calls out of the text."""

    calls_begin, calls_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    begin, sep, end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    fence_open, fence_close = "```json\n", "\n```"

    def __init__(self) -> None:
        super().__init__()
        self.state = "content"  # content | block | header | args
        self._fenced = False

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        self.buf += text
        out = ParsedDelta()
        while True:
            if self.state == "content":
                marker = self._content_until(out, (self.calls_begin, self.begin), final)
                if marker is None:
                    return out
                self.state = "block" if marker == self.calls_begin else "header"
            elif self.state == "block":
                rest = self.buf.lstrip()
                if rest.startswith(self.calls_end):
                    self.buf, self.state = rest[len(self.calls_end):], "content"
                elif rest.startswith(self.begin):
                    self.buf, self.state = rest[len(self.begin):], "header"
                elif rest and not (self.calls_end.startswith(rest) or self.begin.startswith(rest)):
                    self.state = "content"  # text after the calls: back to content
                else:
                    if final:
                        out.content += self.buf
                        self.buf = ""
                    return out
            elif self.state == "header":
                i = self.buf.find(self.sep)
                if i < 0:
                    return out
                kind, after = self.buf[:i].strip(), self.buf[i + len(self.sep):]
                if kind == "function":  # V3: the name runs to the end of the line, then a ```json fence
                    nl = after.find("\n")
                    if nl < 0 or (len(after) - nl - 1 < len(self.fence_open) and not final):
                        return out
                    name, body = after[:nl].strip(), after[nl + 1:]
                    self._fenced = body.startswith(self.fence_open)
                    self.buf = body[len(self.fence_open):] if self._fenced else body
                else:  # V3.1: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
                    name, self.buf, self._fenced = kind, after, False
                call = self._open_call(name)
                out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, call["id"], name))
                self.state = "args"
            else:  # args
                terminator = (self.fence_close if self._fenced else "") + self.end
                j = self.buf.find(self.end)
                if j >= 0:
                    args = self.buf[:j]
                    if self._fenced and args.rstrip().endswith("```"):
                        args = args.rstrip()[:-3]
                    args = args.rstrip()
                else:
                    args = self.buf if final else self.buf[: len(self.buf) - _held_suffix(self.buf, terminator)]
                    args = args if final else args.rstrip()
                self._send_args(out, args)
                if j < 0:
                    return out
                self.buf, self.state = self.buf[j + len(self.end):], "block"


TOOL_FORMATS = {"hermes": ToolCallParser, "deepseek": DeepSeekToolCallParser}


def tool_format_for(special_tokens) -> str:
    """The tool-call format a tokenizer's special tokens imply."""
    return "deepseek" if DeepSeekToolCallParser.begin in special_tokens else "hermes"


class MessageParser:
    """Reasoning first, then tool calls in the answer; ``feed`` each text delta, ``final=True`` last."""

    def __init__(self, reasoning: ReasoningParser | None, tools: bool, tool_format: str = "hermes") -> None:
        self.reasoning = reasoning
        self.tools = TOOL_FORMATS[tool_format]() if tools else None

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        reasoning, content = (self.reasoning.feed(text, final) if self.reasoning is not None else ("", text))
        if self.tools is None:
            return ParsedDelta(content=content, reasoning=reasoning)
        out = self.tools.feed(content, final)
        out.reasoning = reasoning
        return out

    @property
    def tool_calls(self) -> list[dict]:
        return self.tools.calls if self.tools is not None else []


def tool_call_grammar(tools: list[dict], only: str | None = None) -> str:
    """An EBNF grammar (for the structured-output feature) that forces one ``<tool_call>`` block
    calling one of ``tools`` (or the named one) with arguments valid under its JSON schema."""
    import xgrammar as xg

    alternatives = []
    for t in tools:
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        alternatives.append({"type": "object", "properties": {
            "name": {"const": fn["name"]}, "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False})
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    body = str(xg.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                           separators=(", ", ": ")))
    body = re.sub(r"^root ::=", "tool_call_body ::=", body, flags=re.MULTILINE)
    return f'root ::= "<tool_call>" tool_call_body "</tool_call>"\n{body}'
