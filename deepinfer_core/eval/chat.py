"""Turning an item's ``messages`` into an engine prompt.

A checkpoint with a chat template (``tokenizer_config.json`` ``chat_template`` or ``chat_template.jinja``)
is encoded by the LLM's own chat encoder (``LLM.chat_encoder``, the one ``LLM.chat`` and
``deepinfer serve`` use: special tokens placed by id, message text that spells a special token kept
as plain text). A checkpoint without one (the embedded model is a plain code model) gets the plain
layout ``"System: ...\\n\\nUser: ...\\n\\nAssistant:"``. Each generation record's ``prompt_format`` says
which was used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PLAIN_FORMAT = "plain"
TEMPLATE_FORMAT = "chat_template"


def has_chat_template(model_dir: Path) -> bool:
    cfg_path = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    return bool(cfg.get("chat_template")) or (Path(model_dir) / "chat_template.jinja").is_file()


def render_plain(messages: list[dict[str, str]]) -> str:
    return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages) + "\n\nAssistant:"


class Prompter:
    """An item's prompt for ``LLM.generate``: (engine prompt, its text for the record, prompt_format)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.template = has_chat_template(llm.engine.model_dir)
        self.encoder = getattr(llm, "chat_encoder", None) if self.template else None
        if self.template and self.encoder is None:
            self.error = (f"model directory {str(llm.engine.model_dir)!r} has a chat template, and encoding "
                          "'messages' with it needs the LLM's chat encoder (LLM.chat_encoder), which this build "
                          "lacks; give the items a 'prompt' instead")
        else:
            self.error = None

    def __call__(self, prompt: str | None, messages: list[dict[str, str]] | None) -> tuple[Any, str, str]:
        if prompt is not None:
            return prompt, prompt, "prompt"
        if not self.template:
            text = render_plain(messages)
            return text, text, PLAIN_FORMAT
        if self.error:
            raise ValueError(self.error)
        ids = self.encoder.encode(messages, add_generation_prompt=True)
        return {"prompt_token_ids": ids}, self.encoder.tk.decode(ids, skip_special_tokens=False), TEMPLATE_FORMAT
