"""Turning an item's ``messages`` into prompt text.

A checkpoint whose ``tokenizer_config.json`` has a ``chat_template`` is rendered with it (jinja2,
sandboxed, ``add_generation_prompt=True``). The BOS token is rendered as an empty string: the engine
prepends BOS itself and encodes special-looking text as plain text. A checkpoint without a template
(the embedded model is a plain code model) gets the plain layout below, and the generation records
say which one was used (``prompt_format``).
"""

from __future__ import annotations

import json
from pathlib import Path

PLAIN_FORMAT = "plain"  # "System: ...\n\nUser: ...\n\nAssistant:"
TEMPLATE_FORMAT = "chat_template"


class ChatRenderer:
    def __init__(self, model_dir: Path) -> None:
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.template_text = cfg.get("chat_template")
        if isinstance(self.template_text, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in self.template_text if isinstance(t, dict)}
            self.template_text = named.get("default")
        self.eos_text = _token_text(cfg.get("eos_token"))
        self.format = TEMPLATE_FORMAT if self.template_text else PLAIN_FORMAT
        self._template = None
        if self.template_text:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.template_text)

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._template is not None:
            return self._template.render(messages=messages, add_generation_prompt=True, bos_token="",
                                         eos_token=self.eos_text or "")
        parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        return "\n\n".join(parts) + "\n\nAssistant:"


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value
