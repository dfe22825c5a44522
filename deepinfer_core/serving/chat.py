"""Chat encoding (the "recipe"): a conversation to prompt token ids, safe against token injection.

The conversation is rendered with the checkpoint's chat template (``tokenizer_config.json``
``chat_template``, or one given explicitly), a Jinja template run in jinja2's immutable sandbox.
Special tokens then become ids **by position**, and only the ones the template itself wrote:

1. Every string the client supplied (message contents, names, tool-call arguments, tool
   definitions) is *neutralised* before rendering: each special-token spelling in it is replaced by
   a private-use placeholder (U+E000 k U+E001), which no template logic or tokenizer treats as
   special.
2. The rendered text is split at the special-token spellings left in it, all of which come from
   the template; each becomes its id.
3. The text between them has its placeholders restored to the original spelling and is encoded as
   plain text (``encode_special_tokens``), so "<|end_of_text|>" typed by a user is a few ordinary
   tokens, never the end-of-text id.

Splitting at special tokens first is also what ``tokenizers`` does when it encodes a whole string,
so a conversation without injected text encodes to exactly the ids that ``apply_chat_template``
would give. The end of an assistant turn is the special token the template writes right after an
assistant message (:attr:`ChatEncoder.turn_end_ids`), matched by id while decoding.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

_OPEN, _CLOSE = "\ue000", "\ue001"  # placeholder brackets (Unicode private use area)
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
_STEERING_KEYS = {"role", "type"}  # values the template branches on: validated, never neutralised


class ChatTemplateError(ValueError):
    """The model has no usable chat template, or the template failed to render the conversation."""


def load_chat_template(model_dir: Path, override: str | None = None) -> str | None:
    """The template text: ``override`` (a path or the template itself), else the checkpoint's."""
    if override is not None:
        p = Path(override)
        if "{" not in override and p.is_file():
            return p.read_text()
        return override
    path = Path(model_dir) / "tokenizer_config.json"
    tmpl = json.loads(path.read_text()).get("chat_template") if path.is_file() else None
    if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    if tmpl is None and (Path(model_dir) / "chat_template.jinja").is_file():
        tmpl = (Path(model_dir) / "chat_template.jinja").read_text()
    return tmpl


def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


class ChatEncoder:
    """Conversations to prompt ids for one tokenizer and chat template."""

    def __init__(self, model_dir: Path, tokenizer, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.tk = getattr(tokenizer, "tk", None)
        if self.tk is None:
            raise ChatTemplateError(f"model directory {str(model_dir)!r} has no tokenizer.json; chat needs one")
        text = load_chat_template(model_dir, chat_template)
        if text is None:
            raise ChatTemplateError(f"model directory {str(model_dir)!r} has no chat template (tokenizer_config.json "
                                    "'chat_template'); pass one (--chat-template / chat_template=)")
        self.template_text = text
        self.template = _compile(text)
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        self.token_vars = {}
        tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = tcfg.get(key)
            self.token_vars[key] = v.get("content") if isinstance(v, dict) else v or ""
        specials = {t.content: i for i, t in self.tk.get_added_tokens_decoder().items() if t.special}
        self.special_ids = specials
        self.special_texts = sorted(specials, key=len, reverse=True)  # longest first: no prefix shadowing
        self._split = re.compile("(" + "|".join(map(re.escape, self.special_texts)) + ")") if specials else None
        self.turn_end_ids = self._find_turn_end()

    # ---- encoding -------------------------------------------------------------------------
    def encode(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **template_kwargs: Any) -> list[int]:
        """Prompt ids for a conversation (ChatTemplateError for a template failure)."""
        return self.encode_text(self.render(messages, add_generation_prompt, tools, **template_kwargs))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **template_kwargs: Any) -> str:
        """The rendered conversation, with the client's special-token spellings still neutralised."""
        from jinja2.exceptions import TemplateError

        msgs = [self._neutralise(_normalise_message(m)) for m in messages]
        try:
            return self.template.render(messages=msgs, tools=self._neutralise(tools) if tools else None,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.token_vars, **self._neutralise(template_kwargs))
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed on this conversation: {exc}") from exc
        except (TypeError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on this conversation: {type(exc).__name__}: {exc}") from exc

    def encode_text(self, rendered: str) -> list[int]:
        """Ids of a rendered conversation: its special-token spellings (the template's) by id, the
        text between them as plain text."""
        ids: list[int] = []
        pieces = self._split.split(rendered) if self._split is not None else [rendered]
        for i, piece in enumerate(pieces):
            if i % 2:  # a separator: a special token the template wrote
                ids.append(self.special_ids[piece])
            elif piece:
                ids += self.tk.encode(self._restore(piece), add_special_tokens=False).ids
        return ids

    # ---- helpers --------------------------------------------------------------------------
    def _neutralise(self, value):
        if isinstance(value, str):
            if self._split is None:
                return value
            return self._split.sub(lambda m: f"{_OPEN}{self.special_texts.index(m.group(0))}{_CLOSE}", value)
        if isinstance(value, dict):
            return {k: (v if k in _STEERING_KEYS else self._neutralise(v)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._neutralise(v) for v in value]
        return value

    def _restore(self, text: str) -> str:
        if _OPEN not in text:
            return text

        def back(m: re.Match) -> str:
            k = int(m.group(1))
            return self.special_texts[k] if k < len(self.special_texts) else m.group(0)

        return _PLACEHOLDER.sub(back, text)

    def _find_turn_end(self) -> list[int]:
        """The special token(s) the template writes right after an assistant message's text."""
        marker = "\ue002"
        try:
            ids = self.encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                              add_generation_prompt=False)
        except ChatTemplateError:
            return []
        marker_ids = self.tk.encode(marker, add_special_tokens=False).ids
        for start in range(len(ids) - len(marker_ids), -1, -1):
            if ids[start : start + len(marker_ids)] == marker_ids:
                after = ids[start + len(marker_ids):]
                specials = set(self.special_ids.values())
                return [after[0]] if after and after[0] in specials else []
        return []


def _normalise_message(message: dict) -> dict:
    """OpenAI content parts ([{"type": "text", "text": ...}]) joined to one string; tool-call
    arguments given as JSON text also offered parsed (templates differ in which they expect)."""
    if not isinstance(message, dict):
        raise ChatTemplateError(f"a message must be an object with 'role' and 'content', got {type(message).__name__}")
    m = dict(message)
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"message content part {part!r} is not supported (only "
                                        "{'type': 'text', 'text': ...})")
            texts.append(part["text"])
        m["content"] = "".join(texts)
    calls = m.get("tool_calls")
    if calls:
        out = []
        for call in calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments_obj"] = json.loads(args)
                except json.JSONDecodeError:
                    pass
            call["function"] = fn
            out.append(call)
        m["tool_calls"] = out
    return m
