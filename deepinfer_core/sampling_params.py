"""SamplingParams, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seq_seed: int | None = None  # per-request RNG seed, any int (taken modulo 2**64); random when None
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one), clamped to the vocab
    prompt_logprobs: int | None = None  # 0: each prompt token's own logprob; N: also the top N (clamped to the vocab)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Options owned by feature plugins (validated by them): structured output, request class, ...
    so_args: dict | None = None
    traffic_class: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TypeError(f"unknown SamplingParams field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError/TypeError naming the offending field."""
        def num(name: str, kinds=(int, float)) -> Any:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise TypeError(f"SamplingParams.{name} must be a number, got {type(v).__name__} {v!r}")
            if not math.isfinite(v):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {v!r}")
            return v

        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise TypeError(f"SamplingParams.max_tokens must be an int, got {self.max_tokens!r}")
            if self.max_tokens <= 0:
                raise ValueError(f"SamplingParams.max_tokens must be > 0, got {self.max_tokens}")
        if num("temperature") < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < num("top_p") <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if num("top_k", (int,)) < -1:
            raise ValueError(f"SamplingParams.top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= num("min_p") <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if num("repetition_penalty") <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        num("presence_penalty")
        num("frequency_penalty")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"SamplingParams.{name} must be a non-negative int or None, got {v!r}")
        if self.seq_seed is not None and (isinstance(self.seq_seed, bool) or not isinstance(self.seq_seed, int)):
            raise TypeError(f"SamplingParams.seq_seed must be an int, got {self.seq_seed!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"SamplingParams.stop_token_ids has {t!r}, outside the vocabulary [0, {vocab_size})")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")


def rng_seed(seq_seed: int) -> int:
    """The signed 64-bit seed the counter RNG takes for ``seq_seed``: its value modulo 2**64 (so any
    int is accepted, and ``s`` and ``s + 2**64`` draw alike)."""
    seed = seq_seed & ((1 << 64) - 1)
    return seed - (1 << 64) if seed >= 1 << 63 else seed
