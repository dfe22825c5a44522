"""Tokenizer loading (``tokenizers``' tokenizer.json) with BOS handling from the HF config files.

User text is always encoded as plain text: a string that looks like a special token (say
"<|end_of_text|>") is split like any other text, never turned into the special token.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


class TokenizerError(ValueError):
    pass


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer:
    def __init__(self, model_dir: Path, tk: Tokenizer, bos_token_id: int | None, eos_token_ids: list[int]) -> None:
        self.tk = tk
        self.tk.encode_special_tokens = True  # special-looking user text stays plain text
        cfg_path = model_dir / "tokenizer_config.json"
        tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        bos_text = _token_text(tcfg.get("bos_token"))
        eos_text = _token_text(tcfg.get("eos_token"))
        self.bos_token_id = self.tk.token_to_id(bos_text) if bos_text else bos_token_id
        self.add_bos = bool(tcfg.get("add_bos_token", self.bos_token_id is not None)) and self.bos_token_id is not None
        eos = list(eos_token_ids)
        if eos_text and self.tk.token_to_id(eos_text) is not None and self.tk.token_to_id(eos_text) not in eos:
            eos.append(self.tk.token_to_id(eos_text))
        self.eos_token_ids = eos
        self.vocab_size = self.tk.get_vocab_size()

    @classmethod
    def load(cls, model_dir: Path, bos_token_id: int | None, eos_token_ids: list[int]):
        """The checkpoint's tokenizer, or a :class:`NoTokenizer` when it ships none."""
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            return NoTokenizer(model_dir, eos_token_ids)
        return cls(model_dir, Tokenizer.from_file(str(path)), bos_token_id, eos_token_ids)

    def encode(self, text: str) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=True).ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tk.id_to_token(i)


class NoTokenizer:
    """Stand-in for checkpoints without tokenizer files: token-id prompts only, no text output."""

    def __init__(self, model_dir: Path, eos_token_ids: list[int]) -> None:
        self.model_dir, self.eos_token_ids, self.bos_token_id = model_dir, list(eos_token_ids), None

    def encode(self, text: str) -> list[int]:
        raise TokenizerError(f"prompt is text but model directory {str(self.model_dir)!r} has no tokenizer.json; "
                             "pass {'prompt_token_ids': [...]}")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def id_to_token(self, i: int) -> str | None:
        return None
