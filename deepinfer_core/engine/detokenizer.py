"""Incremental detokenization: the text of a growing output, one token at a time.

``tokenizers``' ``DecodeStream`` turns each new token into the text it adds, holding back a token
whose bytes end inside a UTF-8 sequence until the sequence completes. Appending a token therefore
costs O(1), where re-decoding the whole output every step costs O(n) (quadratic over a request).

Stop strings are searched only in the window the new text can complete: the new text plus the
``max_stop_len - 1`` characters before it.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from deepinfer_core.outputs import Logprob


class IncrementalDetokenizer:
    """The text of ``token_ids`` fed so far (``feed``), equal to ``tokenizer.decode(token_ids)``."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._tk = getattr(tokenizer, "tk", None)  # None: a checkpoint without tokenizer.json (no text)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._tk is not None else None
        self.text = ""
        self.num_tokens = 0

    def feed(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text they add (may be empty while a UTF-8 sequence is open)."""
        self.num_tokens += len(token_ids)
        if self._stream is None:
            return ""
        pieces = [self._stream.step(self._tk, t) for t in token_ids]
        new = "".join(p for p in pieces if p)
        self.text += new
        return new

    def find_stop(self, stops: list[str], num_new_chars: int) -> str | None:
        """The first stop string that ends in the last ``num_new_chars`` characters, if any."""
        if not stops or not num_new_chars:
            return None
        window = self.text[-(num_new_chars + max(len(s) for s in stops) - 1):]
        hits = [(window.find(s), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        return min(hits)[1] if hits else None


def stop_string_hit(seq, tokenizer) -> str | None:
    """Feed a request's new output tokens to its detokenizer (created on first use, kept on the
    request) and return the stop string they complete, if any."""
    detok = seq.detokenizer
    if detok is None:
        detok = seq.detokenizer = IncrementalDetokenizer(tokenizer, seq.params.skip_special_tokens)
    new = detok.feed(seq.token_ids[seq.num_prompt_tokens + detok.num_tokens : seq.num_known_tokens])
    return detok.find_stop(seq.params.stop, len(new))


def truncate_at_stop(text: str, stop: str, include: bool) -> str:
    """The output text of a request that stopped at stop string ``stop``."""
    i = text.find(stop)
    if i < 0:
        return text
    return text[: i + len(stop)] if include else text[:i]


class TokenTexts:
    """``Logprob.decoded_token`` for token ids: each id's own text, cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        t = self._cache.get(token_id)
        if t is None:
            tk = getattr(self.tokenizer, "tk", None)
            t = tk.decode([token_id], skip_special_tokens=False) if tk is not None else ""
            self._cache[token_id] = t
        return t

    def fill(self, entries: list[dict[int, Logprob] | None] | None) -> None:
        for entry in entries or ():
            for tid, lp in (entry or {}).items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.text(tid)
